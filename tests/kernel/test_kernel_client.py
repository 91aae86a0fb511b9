"""The kernel client that kernel tests and benchmarks share (tests/support/kernel_client.py)."""

import os
import stat

from tests.support.kernel_client import WITHOUT_GPUS, Kernel


def test_the_kernels_channels_are_unix_sockets_in_a_private_directory():
    # Over TCP the manager picks free ports that the kernel binds a moment later; on a busy host
    # another process took one in between and the kernel died at start ("Address already in use").
    kernel = Kernel(env=WITHOUT_GPUS)
    info = kernel.manager.get_connection_info()
    sockets = os.path.dirname(info["ip"])
    try:
        assert kernel.execute("print('up')").stdout == "up\n"
        assert info["transport"] == "ipc", info
        channels = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
        assert all(stat.S_ISSOCK(os.stat(f"{info['ip']}-{info[name]}").st_mode) for name in channels)
        assert stat.S_IMODE(os.stat(sockets).st_mode) == 0o700
    finally:
        kernel.stop()
    assert not os.path.exists(sockets)
