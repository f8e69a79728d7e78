"""ctest entry point: runs one check_<op>.py, or exits 77 (skipped) where numpy or ml_dtypes is missing."""
import importlib.util
import runpy
import sys

for module in ("numpy", "ml_dtypes"):
    if importlib.util.find_spec(module) is None:
        print(f"{module} is not installed: cross-check skipped")
        sys.exit(77)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
