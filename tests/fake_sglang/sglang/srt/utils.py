"""Mirrors the helpers of sglang/srt/utils.py (0.5.2) that veRL and the fake's processes use, with 0.5.2's bodies."""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import socket
import sys
import tempfile
import threading
import traceback
from importlib.metadata import PackageNotFoundError, version

import psutil
import torch
import zmq
from packaging import version as pkg_version

logger = logging.getLogger(__name__)


def is_cuda():
    return torch.cuda.is_available() and torch.version.cuda


def assert_pkg_version(pkg: str, min_version: str, message: str):
    try:
        installed_version = version(pkg)
        if pkg_version.parse(installed_version) < pkg_version.parse(min_version):
            raise Exception(
                f"{pkg} is installed with version {installed_version}, which "
                f"is less than the minimum required version {min_version}. " + message
            )
    except PackageNotFoundError:
        raise Exception(f"{pkg} with minimum required version {min_version} is not installed. " + message)


def kill_process_tree(parent_pid, include_parent: bool = True, skip_pid: int = None):
    """Kill the process and all its child processes."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if parent_pid is None:
        parent_pid = os.getpid()
        include_parent = False
    try:
        itself = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return
    for child in itself.children(recursive=True):
        if child.pid == skip_pid:
            continue
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    if include_parent:
        try:
            if parent_pid == os.getpid():
                itself.kill()
                sys.exit(0)
            itself.kill()
            itself.send_signal(signal.SIGQUIT)
        except psutil.NoSuchProcess:
            pass


def set_ulimit(target_soft_limit=65535):
    resource_type = resource.RLIMIT_NOFILE
    current_soft, current_hard = resource.getrlimit(resource_type)
    if current_soft < target_soft_limit:
        try:
            resource.setrlimit(resource_type, (target_soft_limit, current_hard))
        except ValueError as e:
            logger.warning(f"Fail to set RLIMIT_NOFILE: {e}")


prometheus_multiproc_dir = None


def set_prometheus_multiproc_dir():
    global prometheus_multiproc_dir
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        prometheus_multiproc_dir = tempfile.TemporaryDirectory(dir=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    else:
        prometheus_multiproc_dir = tempfile.TemporaryDirectory()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = prometheus_multiproc_dir.name


def is_port_available(port):
    """Return whether a port is available."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
            s.listen(1)
            return True
        except socket.error:
            return False
        except OverflowError:
            return False


def get_ip() -> str:
    # 0.5.2 reads SGLANG_HOST_IP / HOST_IP, then probes the network interfaces; the fake stays offline.
    host_ip = os.getenv("SGLANG_HOST_IP", "") or os.getenv("HOST_IP", "")
    if host_ip:
        return host_ip
    try:
        return socket.gethostbyname(socket.gethostname())
    except Exception:
        return "0.0.0.0"


def get_open_port() -> int:
    port = os.getenv("SGLANG_PORT")
    if port is not None:
        port = int(port)
        while True:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("", port))
                    return port
            except OSError:
                port += 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def get_zmq_socket(context: zmq.Context, socket_type: zmq.SocketType, endpoint: str, bind: bool):
    socket_ = context.socket(socket_type)
    if socket_type == zmq.PUSH:
        socket_.setsockopt(zmq.SNDHWM, 0)
    elif socket_type == zmq.PULL:
        socket_.setsockopt(zmq.RCVHWM, 0)
    elif socket_type == zmq.DEALER:
        socket_.setsockopt(zmq.SNDHWM, 0)
        socket_.setsockopt(zmq.RCVHWM, 0)
    else:
        raise ValueError(f"Unsupported socket type: {socket_type}")
    if bind:
        socket_.bind(endpoint)
    else:
        socket_.connect(endpoint)
    return socket_


def configure_logger(server_args, prefix: str = ""):
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper()),
        format=f"[%(asctime)s{prefix}] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )


def kill_itself_when_parent_died():
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def get_exception_traceback():
    etype, value, tb = sys.exc_info()
    return "".join(traceback.format_exception(etype, value, tb))
