"""`LoRARequest` (vLLM's): which adapter a request runs with."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter to run a request with: `lora_name` names it (the API's `model`,
    and the prefix cache keeps its blocks apart from the base model's and other adapters'),
    `lora_int_id` (>= 1) identifies it in the engine, `lora_path` is its folder
    (`adapter_config.json` and `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or \
                self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")
