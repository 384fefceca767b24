"""What a PEFT adapter's tensors are called inside a training checkpoint (``peft`` exports them; ``hf`` refuses to
build a full model from a checkpoint that holds nothing else)."""
from __future__ import annotations

import re

# `<module>.lora_A.<adapter>.weight`, `<module>.modules_to_save.<adapter>.weight`, ...: the adapter's own
# tensors, with the adapter name as the segment after the tuner's (PEFT strips ".<adapter>" on save).
ADAPTER_TENSOR = re.compile(r"\.(lora_[A-Za-z_]+|modules_to_save|lora_magnitude_vector)\.(?P<adapter>[^.]+)\.")
