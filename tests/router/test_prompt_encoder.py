"""The router encodes prompts exactly as the workers' model expects, or does not start."""

from __future__ import annotations

import subprocess
import sys

from kvxfer.model.tokenizer import BOS_ID, ByteTokenizer
from kvxfer_router.openai_api import default_prompt_encoder


def test_the_router_encodes_prompts_with_the_models_tokenizer_bos_first() -> None:
    encode = default_prompt_encoder()
    assert encode("héllo") == ByteTokenizer().encode("héllo")
    assert encode("héllo")[0] == BOS_ID


def test_a_broken_tokenizer_import_stops_the_router_instead_of_changing_the_tokens() -> None:
    # Before: the router caught the ImportError, logged a warning and encoded raw bytes
    # without BOS, so every generation silently differed from the colocated one.
    code = (
        "import sys; sys.modules['kvxfer.model.tokenizer'] = None\n"
        "import kvxfer_router.openai_api as api\n"
        "print(api.default_prompt_encoder()('hi'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, f"router imported and encoded without its tokenizer: {proc.stdout}"
    assert "ImportError" in proc.stderr or "ModuleNotFoundError" in proc.stderr, proc.stderr
