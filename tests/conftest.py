"""Puts tests/ on sys.path so test modules import shared helpers as `support.*`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
