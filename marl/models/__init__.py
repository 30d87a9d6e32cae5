"""Models and adapters: the demo model, GGUF import, LoRA config, model identity and limits."""
