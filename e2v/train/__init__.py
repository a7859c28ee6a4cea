"""One training step and everything around it: flow matching (flow), the step (step), the DeepSpeed
config and engine (ds_config, engine), non-finite guards (guard), logged scalars (runlog),
checkpoints and resume (checkpoint), and the exports (export, comfy). Imports the stages above it."""
