# mirrors sglang/version.py (0.5.2)
__version__ = "0.5.2"
