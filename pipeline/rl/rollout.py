"""The rollout engine: batched, KV-cached sampling of G completions per prompt, and log-probs.

``rollout_prompts`` encodes each prompt once, left-pads the batch, runs ONE prefill of the B
distinct prompts, repeats the cache G times (group-contiguous rows ``i*G .. i*G+G-1``), then
decodes all N = B*G rows together, one token per step, from the cache. Stop detection is
vectorised (a row is done after any of ``policy.stop_ids``: end-of-text, a HF model's end-of-turn
ids from its generation_config, `</answer>`); the loop ends when every row is done
or after `max_new_tokens`. Every `COMPACT_EVERY` steps, once the finished rows are a quarter of
the rows still decoding, they leave the decoder's cache: completions vary in length, and about half
of a fixed batch's row-steps would otherwise go to rows that have already answered. With one row
per prompt any stopped row leaves; the G rows of a group share their prompt's keys, so a group
leaves once all its rows have stopped; the batch never shrinks below `COMPACT_MIN_ROWS`. The
sampler still draws one uniform per row of the whole batch each step and hands each remaining row
its own, so the draws, and the tokens and log-probs, are those of decoding every row to the end: on
CPU fp32 at one thread (the default) the same bits (tests/test_row_dropping.py). Elsewhere a kernel may
round a smaller batch differently (CUDA, bf16; at more threads torch's CPU SDPA, which the GPT's
per-row cache uses, splits its work by the batch size), so a draw near a boundary can differ; each
run stays reproducible.

Recorded log-probs: ``logprobs[:, t] = log_softmax(logits / temperature)[token]``, the
FULL-vocabulary distribution at the sampling temperature, before top-k / top-p truncation (the
same quantity ``Policy.token_logprobs`` gives with the same `temperature`; with temperature 1 it is
the plain model distribution the GRPO ratio needs). Greedy decoding records it too.

Layout of every (N, T) tensor, T = prompt width + generated steps:
``[left pads | prompt | response tokens (ending with the stop token) | right pads]``;
``logprobs[:, t]`` is log p(input_ids[:, t] | input_ids[:, :t]) on response tokens, 0 elsewhere.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.model import fast
from pipeline.model.attention import positions_from_mask
from pipeline.model.fast.packed import packed_linears
from pipeline.model.policy import Policy


@dataclass
class Rollout:
    input_ids: torch.Tensor
    """(N, T) prompt (left-padded) + response (right-padded with pad_id)."""
    attention_mask: torch.Tensor
    """(N, T) 1 on prompt and response tokens, 0 on pads."""
    response_mask: torch.Tensor
    """(N, T) 1 on response tokens up to and including the stop token."""
    logprobs: torch.Tensor
    """(N, T) float32 sampling log-probs of the response tokens, 0 elsewhere."""
    texts: list[str]
    """Decoded responses (up to and including `</answer>`; no pad, eos or end-of-turn token)."""
    response_lengths: torch.Tensor
    """(N,) long: response tokens, stop token included."""
    truncated: torch.Tensor
    """(N,) bool: hit max_new_tokens without a stop token."""
    prompt_len: int = 0
    """Width of the (left-padded) prompt block: responses start at this column."""


def left_pad(seqs: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> left-padded ids (B, T) and attention mask (B, T)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, T - len(s):] = 1
    return ids.to(device), mask.to(device)


def _check_args(group_size, max_new_tokens, temperature, top_p, top_k) -> None:
    if group_size < 1:
        raise ValueError(f"group_size = {group_size}; allowed: an integer >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}; allowed: an integer >= 1")
    if not temperature > 0:
        raise ValueError(f"temperature = {temperature}; allowed: a number > 0 (use greedy=True for argmax)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p}; allowed: a number in (0, 1]")
    if top_k < 0:
        raise ValueError(f"top_k = {top_k}; allowed: an integer >= 0 (0 disables it)")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                greedy: bool = False, generator: torch.Generator | None = None,
                rows: torch.Tensor | None = None, batch: int = 0):
    """Next tokens (N,) and their log-probs (N,) under the full distribution at `temperature`.

    `rows` (N,) and `batch`: `logits` are rows `rows` of a batch of `batch` rows (the others have
    left the decode loop); the uniforms are drawn for the whole batch and row i gets its own, so
    the draws do not depend on which rows are still there (the fast-path sampler only)."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature  # (N, V)
    if greedy:
        tokens = scaled.argmax(-1)
        return tokens, scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    if top_k == 0 and top_p >= 1.0 and fast.enabled():
        # no truncation (every GRPO rollout by default): one softmax serves both the draw and the
        # log-prob; log(p) of a drawn token is within ~1e-7 of log_softmax (p > 0: never a zero-mass draw)
        probs = scaled.softmax(-1)  # (N, V)
        tokens = _inverse_cdf_sample(probs, generator, rows, batch)  # (N,)
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    filtered = scaled
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]  # (N, 1)
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = filtered.sort(dim=-1, descending=True)  # (N, V)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # mass before a token already reaches top_p
        filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    tokens = _draw(filtered.softmax(-1), generator, rows, batch)  # (N,)
    return tokens, scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None, rows: torch.Tensor | None = None,
          batch: int = 0) -> torch.Tensor:
    """One token per row of (N, V) probabilities."""
    if not fast.enabled():
        if rows is not None:
            raise ValueError("a subset of rows needs the fast-path sampler (one uniform per row)")
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return _inverse_cdf_sample(probs, generator, rows, batch)


_CDF_BLOCK = 64
COMPACT_EVERY = 8  # every this many steps, ...
COMPACT_FRACTION = 4  # ... drop the finished rows (groups) once they are at least 1/this of the rows decoding
# Never shrink the batch below this many rows: under it MKL picks its matmul kernel by the row count
# (on an AVX2 CPU at one thread 1-3 rows, at two threads every count under 12 that is not a multiple of
# 4), and another kernel sums in another order: other bits than the full batch's rows
# (tests/test_row_dropping.py checks the counts from here up).
COMPACT_MIN_ROWS = 16


def _inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None, rows: torch.Tensor | None = None,
                        batch: int = 0) -> torch.Tensor:
    """One draw per row of (N, V) non-negative weights from ONE uniform per row (with `rows`: one
    uniform per row of a `batch`-row batch, row i of `probs` taking uniform `rows[i]`).

    `torch.multinomial` draws V exponentials per row (the exponential-race trick): 14% of a
    decode step of a tiny Llama on CPU. And a cumulative sum over all V columns is sequential per
    row (the largest op of the sampler on CPU), so the CDF is taken in two levels: the uniform first
    picks a block of 64 columns from the cumulative block totals, then a column inside that block
    from the block's own cumulative sum. The uniform is scaled by the row's own total, so fp32
    rounding only shifts mass by ~1e-7 relative, and both levels search with `right=True` on a
    value clamped inside the chosen block's mass, so a zero-weight column is never drawn.
    """
    N, V = probs.shape
    pad = (-V) % _CDF_BLOCK
    w = F.pad(probs, (0, pad)) if pad else probs
    w = w.view(N, -1, _CDF_BLOCK)  # (N, nb, blk)
    block_mass = w.sum(-1)  # (N, nb)
    block_cdf = block_mass.cumsum(-1)  # (N, nb)
    total = block_cdf[:, -1:]
    if rows is None:
        u = torch.rand(N, 1, generator=generator, device=probs.device) * total
    else:
        u = torch.rand(batch, 1, generator=generator, device=probs.device)[rows] * total
    u = torch.minimum(u, total.nextafter(torch.zeros_like(total)))  # u < total even after rounding
    blk = torch.searchsorted(block_cdf, u, right=True).clamp_(max=w.shape[1] - 1)  # (N, 1): mass > 0
    inner = w.gather(1, blk[:, :, None].expand(N, 1, _CDF_BLOCK)).squeeze(1)  # (N, blk)
    inner_cdf = inner.cumsum(-1)
    last = inner_cdf[:, -1:]
    rest = (u - (block_cdf.gather(1, blk) - block_mass.gather(1, blk))).clamp_(min=0.0)  # mass left in the block
    rest = torch.minimum(rest, last.nextafter(torch.zeros_like(last)))
    col = torch.searchsorted(inner_cdf, rest, right=True).clamp_(max=_CDF_BLOCK - 1)
    # non-finite weights (logits that overflowed) would land in the padding: keep the index valid,
    # its log-prob is then nan and the caller refuses the rollout (pipeline.stages.grpo.check_finite)
    return (blk * _CDF_BLOCK + col).squeeze(-1).clamp_(max=V - 1)


def rollout_prompts(policy: Policy, prompts: list[str], group_size: int, max_new_tokens: int,
                    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                    generator: torch.Generator | None = None, *, stop_ids: list[int] | None = None,
                    prompt_ids: list[list[int]] | None = None) -> Rollout:
    """Sample `group_size` completions of each prompt; see the module docstring for the layout.

    `generator` (on the policy's device) makes sampling reproducible. `stop_ids` overrides the
    policy's stop tokens (`[]`: always generate `max_new_tokens`). `prompt_ids` passes prompts
    already tokenised (then `prompts` may be None).
    """
    _check_args(group_size, max_new_tokens, temperature, top_p, top_k)
    with _no_grad_for(policy):
        rollout = _rollout(policy, prompts, group_size, max_new_tokens, temperature, top_p, top_k, greedy,
                           generator, stop_ids, prompt_ids)
    # Inference tensors (an fp32 rollout's) cannot enter autograd; training recomputes log-probs on
    # input_ids, so hand back ordinary tensors (a copy of a few (N, T) tensors, negligible next to decoding).
    for name in ("input_ids", "attention_mask", "response_mask", "logprobs", "response_lengths", "truncated"):
        setattr(rollout, name, getattr(rollout, name).clone())
    return rollout


def _decode(decoder, logits, next_pos, max_new_tokens: int, stop, pad_id: int, unit: int, sample):
    """The decode loop from the prefill's `logits` (N, V): (tokens (N, max_new_tokens) padded after
    each row's stop, their log-probs, lengths (N,), done (N,): stopped on a stop token, the last step
    index). `sample(logits, rows, N)`: rows (n,) of the batch that `logits` (n, V) belong to (None:
    all of them). `unit` > 0: every `COMPACT_EVERY` steps, once the finished rows are
    1/`COMPACT_FRACTION` of the rows still decoding, they leave the decoder's cache, in whole runs
    of `unit` consecutive rows (a group sharing its prompt's keys leaves when all its rows have
    stopped); 0 keeps every row. `active` holds the rows in the cache, `stopped` their part of `done`."""
    N, dev = logits.shape[0], logits.device
    out_tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    out_logp = torch.zeros((N, max_new_tokens), dtype=torch.float32, device=dev)
    done = torch.zeros(N, dtype=torch.bool, device=dev)  # stopped on a stop token
    lengths = torch.zeros(N, dtype=torch.long, device=dev)
    pad = torch.tensor(pad_id, device=dev)
    check_every = 8 if dev.type == "cuda" else 1  # `done.all()` syncs the GPU: check sparsely
    active, stopped = None, done
    for t in range(max_new_tokens):
        tokens, logp = sample(logits, active, N)  # (n,), (n,)
        tokens = torch.where(stopped, pad, tokens)
        logp = logp.masked_fill(stopped, 0.0)
        if active is None:
            out_tokens[:, t], out_logp[:, t] = tokens, logp
            lengths += (~stopped).long()
        else:
            out_tokens[active, t], out_logp[active, t] = tokens, logp
            lengths[active] += (~stopped).long()
        stopped |= torch.isin(tokens, stop)
        if t + 1 == max_new_tokens or ((t + 1) % check_every == 0 and bool(stopped.all())):
            break
        if unit and (t + 1) % COMPACT_EVERY == 0:
            gone = stopped if unit == 1 else stopped.view(-1, unit).all(-1).repeat_interleave(unit)  # (n,)
            n_gone = int(gone.sum())
            if n_gone * COMPACT_FRACTION >= gone.numel() and gone.numel() - n_gone >= COMPACT_MIN_ROWS:
                keep = (~gone).nonzero().squeeze(-1)  # (n',)
                if decoder.select(keep):
                    active = torch.arange(N, device=dev) if active is None else active
                    done[active[stopped]] = True
                    active, tokens, next_pos, stopped = active[keep], tokens[keep], next_pos[keep], stopped[keep]
                else:
                    unit = 0  # this decoder keeps every row: stop asking
        logits = decoder.step(tokens, next_pos)  # (n, V)
        next_pos = next_pos + 1
    if active is not None:
        done[active[stopped]] = True
    return out_tokens, out_logp, lengths, done, t


@contextlib.contextmanager
def _no_grad_for(policy: Policy):
    """Gradients off for a rollout. Plain fp32: inference mode. Under autocast: no_grad inside ONE
    autocast region for the whole rollout, so autocast casts each weight to the compute dtype once
    and reuses the cast at every decode step (its cast cache lives until the outermost region
    exits, and is off in inference mode, where each step would cast every weight again: on CPU
    those casts cost as much as the bf16 matmuls themselves). The same values either way."""
    if policy.autocast_dtype is None:
        with torch.inference_mode():
            yield
    else:
        with torch.no_grad(), policy.autocast():
            yield


def _rollout(policy, prompts, group_size, max_new_tokens, temperature, top_p, top_k, greedy, generator,
             stop_ids, prompt_ids) -> Rollout:
    tok, dev, G = policy.tokenizer, policy.device, group_size
    if prompt_ids is None:
        prompt_ids = [tok.encode(p) for p in prompts]
    if not prompt_ids or any(len(s) == 0 for s in prompt_ids):
        raise ValueError("rollout_prompts: need at least one prompt, and no prompt may be empty")
    ids, mask = left_pad(prompt_ids, tok.pad_id, dev)  # (B, Tp)
    Tp, N = ids.shape[1], len(prompt_ids) * G
    limit = policy.max_len
    if limit is not None and Tp + max_new_tokens > limit:
        raise ValueError(f"prompt ({Tp} tokens) + max_new_tokens ({max_new_tokens}) > context length {limit}")
    stop = torch.tensor(policy.stop_ids if stop_ids is None else stop_ids, dtype=torch.long, device=dev)

    was_training = policy.module.training
    policy.eval()
    decoder = policy.decoder(Tp + max_new_tokens)
    positions = positions_from_mask(mask)  # (B, Tp)
    # CPU fp32: each linear layer's weight packed once for MKL, not re-packed by every decode matmul.
    cpu_fp32 = dev.type == "cpu" and policy.autocast_dtype is None
    with packed_linears(policy.module, N, enabled=fast.enabled() and cpu_fp32):
        logits = decoder.prefill(ids, mask, positions, G)  # (N, V): one prefill per distinct prompt
        next_pos = positions[:, -1].repeat_interleave(G) + 1  # (N,)
        # Finished rows leave the loop (whole groups where G rows share a prompt); the sampler's
        # uniforms stay per row of the whole batch (the multinomial of the plain path cannot).
        unit = G if fast.enabled() else 0
        out_tokens, out_logp, lengths, done, t = _decode(
            decoder, logits, next_pos, max_new_tokens, stop, tok.pad_id, unit,
            lambda lg, rows, batch: sample_next(lg, temperature, top_p, top_k, greedy, generator, rows, batch))
    policy.train(was_training)

    L = t + 1
    response_mask = (torch.arange(L, device=dev)[None, :] < lengths[:, None]).long()  # (N, L)
    prompt_ids_t, prompt_mask = ids.repeat_interleave(G, dim=0), mask.repeat_interleave(G, dim=0)
    resp_cpu, len_cpu = out_tokens[:, :L].cpu(), lengths.cpu()
    texts = [tok.decode(resp_cpu[i, : len_cpu[i]].tolist()) for i in range(N)]
    return Rollout(
        input_ids=torch.cat([prompt_ids_t, out_tokens[:, :L]], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        response_mask=torch.cat([torch.zeros_like(prompt_mask), response_mask], dim=1),
        logprobs=torch.cat([torch.zeros(N, Tp, device=dev), out_logp[:, :L]], dim=1),
        texts=texts,
        response_lengths=lengths,
        truncated=~done,
        prompt_len=Tp,
    )
