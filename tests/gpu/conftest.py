import pytest


def _hopper_reason() -> str | None:
    try:
        from gemmspec.runtime.arrays import get_device

        dev = get_device(0)
        cc = dev.compute_capability
        if (cc.major, cc.minor) != (9, 0):
            return f"needs a Hopper GPU (sm_90), found sm_{cc.major}{cc.minor}"
    except Exception as e:  # no driver, no GPU, no cuda-python
        return f"no usable CUDA GPU: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None


_REASON = _hopper_reason()


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=_REASON)
    for item in items:
        # The marker, not the folder's name (which every item here has as a keyword): a
        # test of this folder that builds and checks on the CPU runs without a GPU.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
