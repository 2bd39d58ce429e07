"""clawgym as a self-hosted Tinker server: the REST API the `tinker` SDK speaks, served on
clawgym's own learner (peft LoRA), sampling in its process or through vLLM (`engine=vllm`).

    python -m trainers.tinker model=tiny tinker.port=8020
"""
