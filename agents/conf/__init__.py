"""The shared Hydra config tree: groups every entry point composes (`model/`, `engine/`,
`env/`) and `serve.yaml`, the root of `python -m agents.serve`."""
