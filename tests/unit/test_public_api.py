"""`fsdp2nb.__version__` is the installed release and `dir(fsdp2nb)` lists the public API only:
what `__all__` names and the version, and none of the module's own imports."""

from importlib import metadata

import fsdp2nb


def test_the_version_is_the_installed_release():
    assert fsdp2nb.__version__ == metadata.version("fsdp2nb")


def test_dir_lists_the_public_api_and_nothing_else():
    listed = dir(fsdp2nb)
    assert set(listed) == {*fsdp2nb.__all__, "__version__"}
    assert not {"Any", "annotations", "atexit", "importlib"} & set(listed)
