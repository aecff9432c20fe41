"""Every `sglang-offload` subcommand: its arguments (`add_arguments(parser)`) and `run(args)`.

One module per command (config, cache, detect, plan, launch, agent, bench), imported only when
that command runs (`offload.cli.COMMANDS`). No module outside this package and `offload.launch`
(SGLang's own flags) imports argparse.
"""
