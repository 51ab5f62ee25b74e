"""gemmspec: a problem-spec compiler for nested grouped GEMMs on Hopper."""

from .build import build, build_backward, derive_backward
from .errors import ArgumentError, CompileError, GemmspecError, SpecError

__all__ = ["build", "build_backward", "derive_backward", "ArgumentError", "CompileError", "GemmspecError", "SpecError"]
__version__ = "0.1.0"
