"""MiniLM traced with plain `torch.jit.trace`, for the diff page's example: writes the input ids
(`ids.safetensors`: input_ids and attention_mask, as `--input-file` reads them) and the traced
module (`minilm.pt`), both in the current folder. Run from a modeltap checkout (models/ holds the
real MiniLM that scripts/setup.sh unpacks)."""

import warnings

import torch
from safetensors.torch import save_file
from transformers import AutoModel, AutoTokenizer

# the tracer warns of the Python values it fixes as constants: expected for one input
warnings.simplefilter("ignore", torch.jit.TracerWarning)
source = "models/all-MiniLM-L6-v2"
model = AutoModel.from_pretrained(source).eval()
batch = AutoTokenizer.from_pretrained(source)(["hello world"], return_tensors="pt")
ids, mask = batch["input_ids"], batch["attention_mask"]
save_file({"input_ids": ids, "attention_mask": mask}, "ids.safetensors")
torch.jit.save(torch.jit.trace(model, (ids, mask), strict=False), "minilm.pt")
print("wrote ids.safetensors and minilm.pt")
