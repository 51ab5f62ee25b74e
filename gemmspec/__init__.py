"""gemmspec: a problem-spec compiler for nested grouped GEMMs on Hopper."""
