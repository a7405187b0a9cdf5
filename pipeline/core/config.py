"""Typed configuration: one pydantic dataclass per section of ``params.yaml``, mirrored 1:1.

Each key is declared once, here: its type, its default, the range of values it allows (pydantic
``Field`` constraints: ``ge``, ``lt``, a pattern, the members of a ``Literal``) and, in the docstring
under it, what it means (read by pydantic, ``use_attribute_docstrings``; params.yaml's comments are
rendered from it). Types are strict, as a params file should be: ``true`` is no integer and ``2.0``
no step count. Rules that relate two keys (``sft.max_len <= model.block_size``) live in
:mod:`pipeline.core.config_loading`, which reads a params file, applies ``--set`` overrides and turns
pydantic's errors into one line naming the file, the key and what is allowed;
:mod:`pipeline.core.config_render` writes params.yaml from these classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass


class ConfigError(ValueError):
    """A user's configuration mistake; the message is one line and names the key."""


# The instruction names the tags closing one first, never a block such as `<answer>N</answer>`: a model
# that copies the instruction writes nothing a verifier reads as an answer (no `<answer>` before a
# `</answer>`), whatever the answer type (tests/test_own_task.py).
DEFAULT_TEMPLATE = (
    "Solve the problem. Think step by step, then give the final answer alone in tags (</answer> closes <answer>).\n"
    "Question: {question}\nAnswer:"
)
BUILTIN_TASKS = ("gsm8k", "arith", "countdown")  # tasks the prepare stage makes itself (pipeline/data/tasks.py)

def _yaml_float(value: Any) -> Any:
    """YAML 1.1 reads ``1e-3`` as a string; a float key takes it as the number it means."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def allowed(text: str) -> dict[str, Any]:
    """What a key allows, in words, where its constraint is a pattern (the one-line error shows it)."""
    return Field(json_schema_extra={"allowed": text})


# integers fit a signed 64-bit value (numpy and torch seeds do); floats are finite
Int = Annotated[int, Field(ge=-2**63, lt=2**63)]
Float = Annotated[float, BeforeValidator(_yaml_float)]
NonNegInt = Annotated[Int, Field(ge=0)]
PosInt = Annotated[Int, Field(ge=1)]
Procs = Annotated[Int, Field(ge=1, le=1024)]
NonNegFloat = Annotated[Float, Field(ge=0)]
PosFloat = Annotated[Float, Field(gt=0)]
Fraction = Annotated[Float, Field(ge=0, le=1)]
Probability = Annotated[Float, Field(gt=0, le=1)]
EvalStage = Literal["sft", "control", "warmup", "grpo"]  # the training stages whose checkpoint evaluate scores
_IMPORT_PATH = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
RewardName = Annotated[str, Field(pattern=rf"^(correct|format|length|{_IMPORT_PATH})$"),
                       allowed("correct, format, length or module:function (e.g. mypkg.rewards:brevity)")]
AnswerType = Annotated[str, Field(pattern=rf"^(number|text|choice|expression|{_IMPORT_PATH})$"),
                       allowed("number, text, choice, expression or module:function (a checker of your own)")]
TaskName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,39}$"),
                     allowed("a task name: lowercase letters, digits and _, starting with a letter")]

SECTION = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
dataclass = pydantic_dataclass(config=SECTION)  # every section: validated on construction


# Fixed output locations, relative to the working directory (the repo root for dvc/prefect).
DATA_DIR = "data"
CHECKPOINT_DIR = "checkpoints"
METRICS_DIR = "metrics"
PLOTS_DIR = "plots"
REPORTS_DIR = "reports"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the default pipeline: what it is and what it reads. Everything that lists stages
    (the CLI, the registry of stage functions, the GRPO stages' files, MLflow's training runs, the
    flow's summary, run names) derives from :data:`STAGE_TABLE`; dvc.yaml declares the same graph for
    DVC (tests/test_dvc.py holds the two equal)."""

    name: str
    kind: str  # prepare, sft (sft and its control), grpo (warmup and grpo), evaluate
    what: str  # one line: what it does and writes
    init: str | None = None  # the checkpoint it starts from (None: a fresh policy or no policy)
    reference: str | None = None  # the frozen KL reference (GRPO kinds)
    key_params: tuple[str, ...] = ()  # what tells two runs of it apart in a list of run names
    files: tuple[str, ...] = ()  # what a stage that does not train writes

    @property
    def trains(self) -> bool:
        return self.kind in ("sft", "grpo")

    @property
    def outs(self) -> tuple[str, ...]:
        """What it writes, as dvc.yaml's outs (the default pipeline's and the recipe's): a training stage
        its checkpoint and its series."""
        return (f"{CHECKPOINT_DIR}/{self.name}", f"{PLOTS_DIR}/{self.name}.csv") if self.trains else self.files


STAGE_TABLE = (
    Stage("prepare", "prepare", "GSM8K, the arithmetic curriculum, your tasks, the tokenizer into data/",
          key_params=("data.seed",), files=tuple(f"{DATA_DIR}/{f}" for f in (
              "gsm8k_train.jsonl", "gsm8k_val.jsonl", "gsm8k_test.jsonl", "arith_train.jsonl", "arith_eval.jsonl",
              "tokenizer.json", "stats.json", "tasks"))),
    Stage("sft", "sft", "supervised warm start into checkpoints/sft", key_params=("sft.steps", "sft.lr")),
    Stage("warmup", "grpo", "GRPO on its task (the arithmetic curriculum) into checkpoints/warmup", init="sft",
          reference="sft", key_params=("warmup.iterations", "warmup.kl_coef", "warmup.lr")),
    Stage("control", "sft", "SFT trained further, the equal-compute control of the warmup, into checkpoints/control",
          init="sft", key_params=("control.steps", "control.lr")),
    Stage("grpo", "grpo", "GRPO on its task (GSM8K) into checkpoints/grpo", init="warmup", reference="sft",
          key_params=("grpo.iterations", "grpo.kl_coef", "grpo.lr", "grpo.group_size")),
    Stage("evaluate", "evaluate", "every checkpoint scored into metrics/, reports/ and plots/",
          key_params=("evaluate.gsm8k_limit",), files=(REPORTS_DIR, f"{PLOTS_DIR}/accuracy.png",
                                                      f"{PLOTS_DIR}/training_curves.png", f"{PLOTS_DIR}/accuracy.csv")),
)
STAGES = tuple(s.name for s in STAGE_TABLE)  # in pipeline order
TRAINING_STAGES = tuple(s.name for s in STAGE_TABLE if s.trains)
SFT_STAGES = tuple(s.name for s in STAGE_TABLE if s.kind == "sft")  # step-indexed series, sft.csv's columns
GRPO_STAGES = tuple(s.name for s in STAGE_TABLE if s.kind == "grpo")


STAGE_BY_NAME = {s.name: s for s in STAGE_TABLE}


def stage_of(name: str) -> Stage:
    """The table's row of `name` (ValueError naming the stages for another name)."""
    if name not in STAGE_BY_NAME:
        raise ValueError(f"stage={name!r}; allowed: {', '.join(STAGES)}")
    return STAGE_BY_NAME[name]


@dataclass
class DataConfig:
    """prepare stage: GSM8K loading/validation, arithmetic curriculum, tokenizer"""

    gsm8k_source: str = "./datasets/gsm8k"
    """A folder with train/test files (default: the copy committed in the repo), a local JSONL/Parquet file,
    or a Hugging Face dataset id (`openai/gsm8k`)."""
    gsm8k_config: str = "main"
    """Dataset config name used when `gsm8k_source` is a hub id."""
    val_size: NonNegInt = 200
    """GSM8K train rows held out (seeded) as the validation split for model selection."""
    max_bad_fraction: Fraction = 0.01
    """The stage fails if more than this fraction of GSM8K rows is malformed."""
    arith_train_size: Annotated[Int, Field(ge=1, le=10_000_000)] = 20000
    """Arithmetic curriculum problems in the training stream."""
    arith_eval_size: Annotated[Int, Field(ge=1, le=1_000_000)] = 200
    """Arithmetic problems in the held-out evaluation set."""
    arith_max_level: Annotated[Int, Field(ge=1, le=5)] = 4
    """Hardest curriculum level generated (1: one-digit +/-, ..., 5: two-step three-digit)."""
    arith_solution: Literal["digits", "lines"] = "digits"
    """Worked arithmetic solutions: column by column with carries (`digits`) or one line per operation."""
    prompt_template: Annotated[str, Field(pattern=r"\{question\}"), allowed("a string containing {question}")] = DEFAULT_TEMPLATE
    """The prompt template of the built-in gsm8k and arith tasks (a task of `tasks` has its own `prompt`); must
    contain `{question}`."""
    chat_template: bool = False
    """Render each prompt with the model tokenizer's chat template (hf backend): `system_prompt`, then the
    filled `prompt_template` (the question and the answer-format instruction) as the user turn."""
    system_prompt: str = ""
    """System turn of the chat template; empty: none."""
    countdown_train_size: Annotated[Int, Field(ge=1, le=1_000_000)] = 5000
    """Countdown problems in the training split (made only when a stage uses the countdown task)."""
    countdown_eval_size: Annotated[Int, Field(ge=1, le=100_000)] = 200
    """Countdown problems in each of the validation and test splits."""
    countdown_numbers: Annotated[Int, Field(ge=2, le=6)] = 3
    """Numbers given per countdown problem, each to be used exactly once."""
    vocab_size: Annotated[Int, Field(ge=300, le=1_000_000)] = 2048
    """Vocabulary size of the byte-level BPE trained for the from-scratch GPT."""
    seed: Int = 0
    """Seed for the validation split and the curriculum generator."""


@dataclass
class ModelConfig:
    """the policy: from-scratch GPT (CPU default: 4 x 128, ~1.3M params) or any HF causal LM"""

    backend: Literal["gpt", "hf"] = "gpt"
    """`gpt`: the from-scratch GPT of pipeline/model/gpt.py; `hf`: any transformers causal LM."""
    init: str = ""
    """Empty: random init and SFT from scratch. A checkpoint folder or HF model id/folder: start from it."""
    n_layer: Annotated[Int, Field(ge=1, le=1024)] = 4
    """Transformer blocks (gpt backend)."""
    n_head: Annotated[Int, Field(ge=1, le=1024)] = 4
    """Attention heads per block (gpt backend)."""
    n_embd: Annotated[Int, Field(ge=1, le=65536)] = 128
    """Residual stream width (gpt backend)."""
    block_size: Annotated[Int, Field(ge=16, le=131072)] = 512
    """Maximum context length in tokens (prompt + response)."""
    positions: Literal["rope", "learned"] = "rope"
    """Rotary position embeddings or a learned position table (gpt backend)."""
    dropout: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    """Dropout probability during SFT (GRPO always runs the policy without dropout)."""
    device: str = "auto"
    """`auto` (CUDA if available, else CPU), `cpu`, `cuda`, `cuda:N`."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: `auto` is bf16 autocast on CUDA and fp32 on CPU."""
    compile: bool = False
    """Wrap the model in torch.compile (worth it on GPU only)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Weight dtype: float32 (AdamW master weights, autocast picks the compute dtype) or bfloat16 (half the
    memory; checkpoints are saved in this dtype)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward instead of keeping them (hf backend): less memory, ~30% more time."""
    lora_rank: NonNegInt = 0
    """LoRA adapter rank (hf backend, needs `peft`); 0 trains every weight. The KL reference is the base
    model with the adapters off, and the saved checkpoint has the adapters merged in."""
    lora_alpha: PosFloat = 16.0
    """LoRA scaling numerator (the update is alpha / rank * B A)."""
    lora_targets: Annotated[list[Annotated[str, Field(pattern=r"\S")]], Field(min_length=1), allowed("a non-empty list of module names, e.g. [q_proj, v_proj]")] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get LoRA adapters (peft `target_modules`)."""
    num_threads: Annotated[Int, Field(ge=0, le=4096)] = 1
    """torch intra-op CPU threads; 0 = torch's default (one per core). The tiny default runs fastest on 1."""
    cpu_kernels: Literal["native", "avx2", "avx512", "compatible"] = "native"
    """CPU kernels of torch and MKL: `native` (this CPU's own), `avx2` / `avx512` (torch's kernels of that set and
    MKL's reproducibility branch of it, which MKL honours on Intel CPUs only), `compatible` (scalar kernels
    and MKL's branch for any x86-64 CPU; 2.3x an iteration's time on one AMD CPU); pipeline/core/kernels.py."""


@dataclass
class SFTConfig:
    """SFT warm start on curriculum arithmetic + GSM8K solutions"""

    steps: NonNegInt = 4500
    """Optimizer steps of supervised fine-tuning: each of the default budget's 1,000 worked solutions is seen
    about 60 times; some seeds' SFT is still short of its plateau at 4,500 steps (6,000 reach it),
    docs/results/learning.md."""
    batch_size: Annotated[Int, Field(ge=1, le=65536)] = 16
    """Sequences per step."""
    lr: PosFloat = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: NonNegInt = 100
    """Linear LR warmup steps, then cosine decay to 10% of `lr`."""
    weight_decay: NonNegFloat = 0.1
    """AdamW weight decay on matrices."""
    grad_clip: PosFloat = 1.0
    """Max global gradient norm."""
    arith_fraction: Fraction = 0.875
    """Fraction of each batch drawn from the arithmetic curriculum (the rest: GSM8K solutions)."""
    max_len: Annotated[Int, Field(ge=8)] = 256
    """Training sequences longer than this many tokens are dropped."""
    log_every: PosInt = 100
    """Steps between metric logs."""
    eval_every: NonNegInt = 450
    """Steps between validation loss and held-out arithmetic accuracy (the default's checks fall at every
    10% of the run, so the plateau check compares the last two)."""
    eval_samples: NonNegInt = 200
    """Held-out arithmetic problems scored greedily at each evaluation."""
    save_every: PosInt = 500
    """Steps between resumable checkpoints."""
    keep_last: PosInt = 2
    """Resumable checkpoints kept."""
    max_nonfinite: PosInt = 3
    """Stop with an error after this many consecutive non-finite steps."""
    arith_examples: NonNegInt = 1000
    """Worked arithmetic solutions SFT learns from: the first N rows of the training stream (0 = all of it);
    GRPO's warmup still draws its problems (questions and verified answers only) from the whole stream. The
    default is RLVR's premise: a budget of worked solutions, verified answers without limit."""
    arith_max_level: NonNegInt = 0
    """Hardest curriculum level whose worked solutions SFT learns from (0 = every level); harder levels reach
    the policy only through the warmup's verifier (applied before `arith_examples`)."""
    arith_hard_examples: NonNegInt = 0
    """With `arith_max_level`: worked solutions still kept from the harder levels, the first N of them in the
    stream (a scarce budget of hard worked solutions beside plentiful verified answers)."""
    num_threads: Annotated[Int, Field(ge=0, le=4096)] = 1
    """torch intra-op CPU threads of each process of the sft stage (0 = `model.num_threads`); the control,
    which runs beside the warmup, keeps `model.num_threads`. A run's figures depend on its thread and
    process counts (float sums), so they are params like any other."""
    nproc: Procs = 2
    """Processes (torchrun DDP) for this stage, which runs alone in the pipeline's graph: each rank takes
    a share of every batch's sequences (balanced by tokens) and the gradients are summed, the
    single-process update up to float rounding; the held-out checks are split across ranks too. On the
    2-core default, two processes of one thread run a step 1.14x as fast as one process of two
    threads (docs/results/speed.md)."""
    seed: Int = 0
    """Seed for init, batching and dropout."""


@dataclass
class ControlConfig:
    """the warmup's equal-compute baseline: SFT continued from the SFT checkpoint on the same worked-example budget"""

    steps: NonNegInt = 2400
    """Optimizer steps of continued SFT; the default is set so the stage takes about the warmup's wall time
    (the two run side by side, one core each), docs/results/learning.md."""
    lr: PosFloat = 1e-3
    """Peak AdamW learning rate (a fresh optimizer; the other SFT settings are `sft`'s); it ends 8 points above
    3e-4, about where the SFT's cosine ended (docs/results/learning.md)."""
    warmup_steps: NonNegInt = 50
    """Linear LR warmup steps, then cosine decay to 10% of `lr`."""
    eval_every: NonNegInt = 300
    """Steps between validation loss and held-out arithmetic accuracy."""
    nproc: Procs = 1
    """Processes (torchrun DDP) for this stage, as `sft.nproc` (the default runs beside the warmup, one core
    each)."""
    seed: Int = 0
    """Seed for batching and dropout."""


@dataclass
class GRPOConfig:
    """GRPO on GSM8K train, from the warmup checkpoint; reference policy = SFT checkpoint"""

    iterations: NonNegInt = 20
    """GRPO iterations."""
    prompts_per_iter: Annotated[Int, Field(ge=1, le=65536)] = 8
    """Distinct prompts sampled per iteration; each is repeated `group_size` times."""
    group_size: Annotated[Int, Field(ge=2, le=1024)] = 8
    """G: completions per prompt; advantages are relative within a group."""
    grpo_epochs: PosInt = 1
    """Passes over the rollout batch per iteration."""
    minibatch_groups: NonNegInt = 0
    """Whole groups per minibatch (one optimizer step), over all processes; 0 = the whole batch in
    one step."""
    micro_batch_size: NonNegInt = 0
    """Rows per forward/backward, gradients accumulated up to the minibatch (the same update as one pass),
    and per old/reference log-prob pass; 0 = the whole minibatch. Bounds the memory of those passes."""
    lr: PosFloat = 5e-5
    """Peak AdamW learning rate."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to 10% of `lr` at the last iteration."""
    warmup_iters: NonNegInt = 0
    """Linear LR warmup iterations."""
    weight_decay: NonNegFloat = 0.0
    """AdamW weight decay."""
    clip: Annotated[Float, Field(gt=0, lt=1)] = 0.2
    """PPO/GRPO clip epsilon (lower side, and upper side unless `clip_high` is set)."""
    clip_high: Annotated[Float, Field(ge=0, lt=10)] = 0.0
    """DAPO clip-higher upper epsilon; 0 = same as `clip`."""
    kl_coef: NonNegFloat = 0.04
    """beta: weight of the k3 KL to the frozen reference (the SFT checkpoint)."""
    adv_norm: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: per-group std (GRPO), batch std, or none (Dr. GRPO)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation: token-mean (DAPO), seq-mean-token-mean (DeepSeekMath), Dr. GRPO."""
    importance: Literal["token", "sequence"] = "token"
    """Importance ratio per token (GRPO) or per sequence (GSPO)."""
    temperature: PosFloat = 1.0
    """Sampling temperature for rollouts."""
    top_p: Probability = 1.0
    """Nucleus sampling threshold; 1.0 disables it."""
    top_k: NonNegInt = 0
    """Top-k sampling; 0 disables it."""
    rollout_len: PosInt = 128
    """Maximum new tokens per completion."""
    task: TaskName = "gsm8k"
    """The task trained on: its train split gives the prompts, its rewards (`tasks.<name>.rewards`) score
    them, its validation split the held-out checks; a built-in (gsm8k, arith, countdown) or one of `tasks`."""
    fewshot_examples: Annotated[Int, Field(ge=0, le=16)] = 0
    """Worked examples shown before a training prompt's question: the first N rows of the stage's training
    file, rendered as evaluate's few-shot entries are (its `fewshot_examples` is set apart); a scaffold for a
    pretrained model that does not yet write the answer format. Rows asking an example's question stay bare.
    0 = none."""
    fewshot_fade: NonNegInt = 0
    """With `fewshot_examples`: the share of drawn prompts shown the examples falls linearly from 1 at the
    first iteration to 0 from iteration `fewshot_fade` + 1 on (seeded per iteration and row), so the stage
    ends on the bare prompt evaluation scores; at most `iterations`. 0 = shown every prompt throughout."""
    fewshot_mode: Literal["prompt", "guide"] = "prompt"
    """With `fewshot_examples`: `prompt` trains a drawn prompt as shown (the share: each prompt's chance);
    `guide` samples round(share x G / 2) of every group's G completions after the examples and trains all G
    as answers to the bare prompt, so each group sets the examples' answer format against the bare
    prompt's own answers (the guided ones are off-policy: their old log-probs are the bare prompt's)."""
    grad_clip: PosFloat = 1.0
    """Max global gradient norm."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop zero-variance groups and top up with fresh prompts."""
    max_sampling_rounds: PosInt = 3
    """Rollout rounds per iteration allowed for dynamic sampling top-ups."""
    max_nonfinite: PosInt = 3
    """Stop with an error after this many consecutive non-finite steps."""
    log_every: PosInt = 1
    """Iterations between metric logs."""
    eval_every: NonNegInt = 10
    """Iterations between greedy held-out accuracy checks; 0 disables."""
    eval_samples: NonNegInt = 50
    """Held-out problems in each periodic accuracy check."""
    save_every: PosInt = 5
    """Iterations between resumable checkpoints."""
    keep_last: PosInt = 2
    """Resumable checkpoints kept."""
    nproc: Procs = 1
    """Processes (torchrun DDP) for this stage; prompts are sharded by rank."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """How `nproc` > 1 processes hold the model: `ddp` replicates weights, gradients and AdamW's moments on
    every rank; `fsdp` shards them over the ranks (FSDP2, each transformer block its own unit), for a
    model whose training state does not fit one device. Under fsdp each rank samples from a whole copy of
    the weights, refreshed from the shards before every rollout (the rollout needs every weight at every
    step), and the frozen KL reference is sharded too."""
    seed: Annotated[Int, Field(ge=-2**50, lt=2**50)] = 0  # the sampling streams are seeded with seed * 7919 + epoch
    """Seed for prompt order and sampling."""


@dataclass
class WarmupConfig(GRPOConfig):
    """GRPO on the arithmetic curriculum, from the SFT checkpoint"""

    adaptive: bool = False
    """Adaptive curriculum: stop early once both thresholds pass, extend while informative is low."""
    exit_reward: Float = 1.0
    """Adaptive: mean reward (over the last `log_every` window) needed to leave early."""
    exit_accuracy: Fraction = 0.6
    """Adaptive: held-out arithmetic accuracy needed to leave early."""
    min_informative: Fraction = 0.25
    """Adaptive: below this informative fraction the warmup is extended."""
    max_extra_iters: NonNegInt = 0
    """Adaptive: at most this many iterations added beyond `iterations`."""
    level_sampling: Literal["uniform", "informative"] = "uniform"
    """Which curriculum levels the prompts come from: `uniform` (the training stream's own mix) or
    `informative` (a drawn prompt is kept with its level's estimated chance of an informative group, one
    with right and wrong completions, over the best level's: levels the policy always or never solves
    are drawn less; the rates are this run's own, from every group rolled out, decayed by 0.9 per
    iteration)."""
    level_floor: Annotated[Float, Field(gt=0, le=1)] = 0.1
    """`informative`: the least chance that a drawn prompt of any level is kept, so that every level's
    rate stays measured."""


# The warmup's own defaults (its other fields default as for grpo): short arithmetic answers (a
# column-by-column level-4 answer needs up to ~68 tokens), more prompts, a schedule, dynamic sampling on
# (the same end point in two thirds of the iterations, docs/results/cpu-defaults.md), and four clipped
# updates per rollout batch (minibatches of 4 groups); the temperature stays grpo's 1.0 (the recipe
# docs/results/learning.md measures; the earlier recipe's 0.7 was not compared with it on this start).
# 185 iterations take the control's wall time (the two run side by side, one core each).
WARMUP_DEFAULTS: dict[str, Any] = dict(
    task="arith", iterations=185, prompts_per_iter=16, minibatch_groups=4, lr=1e-4, lr_schedule="cosine", warmup_iters=10,
    dynamic_sampling=True, rollout_len=72, eval_every=50, eval_samples=200, save_every=10,
)


@dataclass
class EvalConfig:
    """greedy GSM8K test + held-out arithmetic accuracy of each stage's checkpoint"""

    stages: Annotated[list[EvalStage], Field(min_length=1)] = field(default_factory=lambda: ["sft", "control", "warmup", "grpo"])
    """Checkpoints evaluated, in order."""
    gsm8k_limit: NonNegInt = 0
    """GSM8K test problems evaluated; 0 = all 1,319."""
    arith_limit: NonNegInt = 0
    """Held-out arithmetic problems evaluated; 0 = all."""
    batch_size: Annotated[Int, Field(ge=1, le=65536)] = 64
    """Prompts per generation batch."""
    max_new_tokens: Annotated[Int, Field(ge=1, le=131072)] = 256
    """Maximum new tokens per completion, each row's own whatever the batch (less where its prompt leaves
    less room in the context; a row with none is not scored, counted as `<task>_unscorable`)."""
    samples: Annotated[Int, Field(ge=0, le=1024)] = 8
    """k for pass@k / maj@k / pass@1 (mean sample accuracy); 0 disables sampling metrics."""
    tasks: Annotated[list[TaskName], Field(min_length=1)] = field(default_factory=lambda: ["gsm8k", "arith"])
    """Tasks scored, each on its test split (metrics `<task>_accuracy`, `<task>_format_rate`): built-ins
    (gsm8k, arith, countdown) or names of `tasks`."""
    sample_tasks: list[TaskName] = field(default_factory=lambda: ["arith"])
    """Tasks that get the k samples, where `tasks` scores them; GSM8K sampling costs k greedy passes."""
    temperature: PosFloat = 1.0
    """Sampling temperature for pass@k / maj@k."""
    top_p: Probability = 1.0
    """Nucleus threshold for pass@k / maj@k."""
    seed: Int = 0
    """Seed for the sampling metrics."""
    jobs: NonNegInt = 0
    """Processes scoring checkpoints at once, each with `model.num_threads` threads (the figures do not
    change); 0 = auto: on CPU one per `model.num_threads` cores, at most one per checkpoint; on CUDA 1."""
    fewshot_stages: list[EvalStage] = field(default_factory=list)
    """Checkpoints also scored with `fewshot_examples` worked examples before each question (reported as
    `<stage>_fewshot`): a pretrained model's prompted baseline, which training must beat."""
    fewshot_examples: Annotated[Int, Field(ge=1, le=16)] = 4
    """Worked examples of a few-shot prompt: the first N rows of the task's training file (arithmetic or
    GSM8K train), as earlier user and assistant turns under the chat template, else as text."""
    per_level: bool = True
    """Also report held-out arithmetic accuracy per curriculum level (`arith_level<N>_accuracy`, with its
    95% interval), in metrics/eval.json and as a bar per level in plots/accuracy.*."""


@dataclass
class FieldsConfig:
    """which columns of a task's source hold what"""

    question: Annotated[str, Field(min_length=1)] = "question"
    """The column of the question (put into the task's `prompt` at `{question}`)."""
    answer: Annotated[str, Field(min_length=1)] = "answer"
    """The column of the answer the verifier checks against (for `number`, a number or a text ending in one,
    GSM8K's `#### 42` included)."""
    id: str = ""
    """The column of a row's id; empty: `<task>-<split>-<row number>`."""
    choices: str = ""
    """`choice` answers: the column of the options (a list, shown lettered A, B, ... after the question);
    empty: the options are in the question and the answer is a letter."""
    numbers: str = ""
    """`expression` answers: the column of the numbers to use (the answer column holds the target)."""


@dataclass
class TaskConfig:
    """one task: where its data is, how it is asked, how an answer is checked and rewarded"""

    source: Annotated[str, Field(min_length=1)]
    """A JSONL, Parquet or CSV file or a folder of split files under data_in/ (a DVC dependency of prepare),
    or a Hugging Face dataset id (`owner/name`)."""
    config: str = ""
    """Hub dataset config name (hub ids only)."""
    revision: str = ""
    """Hub dataset revision, a commit to pin the data to (hub ids only; a params value, so a new one re-runs
    prepare)."""
    train_split: Annotated[str, Field(min_length=1)] = "train"
    """The split trained on: `<name>.jsonl|.parquet|.csv` in a folder, a hub split."""
    test_split: str = "test"
    """The split scored by evaluate; empty (or a single file): `test_fraction` of the rows, drawn with
    `data.seed`."""
    test_fraction: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    """With no test split: the share of rows held out as the test split."""
    val_size: NonNegInt = 0
    """Train rows held out (seeded) for GRPO's held-out checks; at most half the train rows."""
    fields: FieldsConfig = field(default_factory=FieldsConfig)
    """Column names."""
    answer: AnswerType = "number"
    """How a completion's answer is checked: `number` (exact value), `text` (case, spacing and punctuation
    at the ends aside), `choice` (a letter), `expression` (countdown: uses each number once, reaches the
    answer), or `module:function`, your `(answer_text, gold) -> bool`."""
    prompt: Annotated[str, Field(pattern=r"\{question\}"), allowed("a string containing {question}")] = DEFAULT_TEMPLATE
    """The prompt; `{question}` is replaced by the question column."""
    rewards: Annotated[list[RewardName], Field(min_length=1, max_length=16)] = field(
        default_factory=lambda: ["correct", "format"])
    """The reward's parts: built-ins `correct` (1 when the answer checks), `format` (1 for exactly one
    `<answer>...</answer>` block holding an answer), `length` (minus the completion's characters / 1000, at
    most 1), or `module:function` with TRL's signature `fn(prompts, completions, **columns)` returning one
    float or None per completion. A params file naming a function names code to run."""
    reward_weights: Annotated[list[Float], Field(min_length=1, max_length=16)] = field(
        default_factory=lambda: [1.0, 0.2])
    """One weight per reward part; the reward is their weighted sum (None counts 0)."""
    max_bad_fraction: Fraction = 0.0
    """The stage fails if more than this fraction of rows is malformed (0: any malformed row)."""


@dataclass
class TrackingConfig:
    """MLflow experiment tracking"""

    enabled: bool = True
    """Log params, metrics and artifacts to MLflow."""
    uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI; the MLFLOW_TRACKING_URI environment variable overrides it."""
    experiment: Annotated[str, Field(pattern=r"\S"), allowed("a non-empty name")] = "grpo-gsm8k"
    """MLflow experiment name."""
    log_model_max_mb: NonNegFloat = 200.0
    """Log each training stage's final checkpoint as an MLflow Model of its run up to this size (MB); 0: never."""
    registered_model: str = "grpo-policy"
    """Model Registry name of the grpo checkpoint (a new version per grpo run); empty: no registration."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    warmup: WarmupConfig = field(default_factory=lambda: WarmupConfig(**WARMUP_DEFAULTS))
    control: ControlConfig = field(default_factory=ControlConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    evaluate: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    tasks: dict[TaskName, TaskConfig] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """`section.key -> value`, for MLflow params."""
        def walk(prefix: str, value: Any):  # tasks.<name>.fields.answer: one param per leaf
            if not isinstance(value, dict):
                yield prefix, value
                return
            for k, v in value.items():
                yield from walk(f"{prefix}.{k}", v)
        return {k: v for s, sec in self.to_dict().items() for k, v in walk(s, sec)}
