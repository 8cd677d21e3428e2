"""Multi-LoRA serving (docs/lora.md): PEFT adapters in a pool of slots, applied per request
inside one batch by a segment-grouped LoRA matmul."""
