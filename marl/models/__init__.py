"""Models and adapters: the demo model, GGUF import, LoRA config, model identity and limits,
the inference engine `auto` resolves to."""
