import sys
from pathlib import Path

# tests import their helpers (fakes, plan_checks, sshhosts) as top-level modules
sys.path.insert(0, str(Path(__file__).resolve().parent))
