import sys
from pathlib import Path

# Spawned ranks import the worker functions by module name: keep tests/ importable for them.
sys.path.insert(0, str(Path(__file__).parent))
