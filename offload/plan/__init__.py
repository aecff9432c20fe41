"""KV-cache sizing: `model` (bytes per token / user, users per GPU, load vs prefill), `presets`
(models and GPUs, or a HuggingFace config.json), `dtypes` (the one element-size table). The
`sglang-offload plan` command is `offload.commands.plan`."""
