"""From a deployment config to SGLang's own command line.

`compose` (validate, detect, decide, build the argv: `prepare() -> LaunchCommand`), `sglang_args`
(the `sglang:` section checked against SGLang's parser), `argspec` (SGLang's parser, live or the
pinned release's snapshot `sglang_args.json`). The `sglang-offload launch` command is
`offload.commands.launch`.
"""
