"""The base every other unit stands on: the config schema and its loading (``config``,
``config_loading``, ``config_render``), one-line errors (``errors``), atomic files (``files``), the
workspace lock (``lock``), the CPU kernel pin (``kernels``), process groups (``distributed``), the
progress bar, the CLI's shared flags (``cli``) and the run's headline table (``summary``)."""
