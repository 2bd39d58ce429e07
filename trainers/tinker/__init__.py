"""clawgym as a self-hosted Tinker server: the REST API the `tinker` SDK speaks, served on
clawgym's own CPU learner (peft LoRA) and a sampler on the same weights.

    python -m trainers.tinker --port 8020 --model tiny
"""
