"""The CUDA data plane, in three modules: :mod:`.device` (the device API and the real CUDA device),
:mod:`.emulated` (a CPU stand-in with deferred, event-ordered streams) and :mod:`.backend` (the copy backend
the job machines drive, and its calibration).
"""

from __future__ import annotations

from kvfsm.data.cuda.backend import CudaCopyBackend, cuda_calibration
from kvfsm.data.cuda.device import CTYPES_MEMCPY_ENV, CUDA_COPY_PATHS, KERNEL_PATH_ENV, CudaDevice, DeviceAPI
from kvfsm.data.cuda.emulated import EmulatedDevice

__all__ = [
    "CTYPES_MEMCPY_ENV",
    "CUDA_COPY_PATHS",
    "KERNEL_PATH_ENV",
    "CudaCopyBackend",
    "CudaDevice",
    "DeviceAPI",
    "EmulatedDevice",
    "cuda_calibration",
]
