"""moe_offload/uva.py without a GPU: the array interface, return-code checks (through a fake runtime), and
the CPU identity of ``ExpertStore.device_rows``. The real mapping is tested in tests/gpu/.

Legend: E experts, B bytes per expert row.
"""

import ctypes
import gc
import weakref

import pytest
import torch

from moe_offload import uva
from moe_offload.host_store import ExpertStore


def test_array_interface_describes_the_host_tensor_at_the_device_address():
    host_ER = torch.zeros(6, 40, dtype=torch.uint8)
    cols = host_ER[:, 8:24]  # a strided column slice, like a bank view
    arr = uva.MappedHostArray(cols, device_ptr=0x7F0000001000, device=torch.device("cuda", 0))
    cai = arr.__cuda_array_interface__
    assert cai["shape"] == (6, 16) and cai["strides"] == (40, 1) and cai["typestr"] == "|u1"
    assert cai["data"] == (0x7F0000001000, False) and cai["version"] == 3
    f32 = uva.MappedHostArray(torch.zeros(3, 5), 0x1000, torch.device("cuda", 0)).__cuda_array_interface__
    assert f32["typestr"] == "<f4" and f32["strides"] == (20, 4)  # byte strides


def test_array_interface_holds_the_host_tensor_alive():
    host = torch.zeros(4, 4, dtype=torch.uint8)
    ref = weakref.ref(host)
    arr = uva.MappedHostArray(host, 0x1000, torch.device("cuda", 0))
    del host
    gc.collect()
    assert ref() is not None and arr.host is ref()


def test_array_interface_refuses_a_dtype_without_a_type_string_naming_the_fix():
    with pytest.raises(ValueError, match="uint8"):
        uva.MappedHostArray(torch.zeros(2, dtype=torch.bfloat16), 0x1000, torch.device("cuda", 0))


def test_mapped_view_on_cpu_is_the_host_tensor_itself():
    host = torch.arange(12, dtype=torch.uint8).view(3, 4)
    assert uva.mapped_device_view(host, "cpu") is host


def test_mapped_view_needs_a_cpu_tensor():
    with pytest.raises(ValueError, match="CPU tensor"):
        uva.mapped_device_view(torch.zeros(2, device="meta"), "cpu")


class FakeRuntime:
    """Records calls; each entry point returns the error code set for it (0 = success)."""

    def __init__(self, **errors):
        self.errors = errors
        self.last_error_cleared = 0
        self.can_map = 1
        self.mem_type, self.device = 1, 0

    def runtime(self):
        def ret(name):
            return self.errors.get(name, 0)

        def get_attr(value_p, attr, dev):
            value_p._obj.value = self.can_map
            return ret("device_get_attribute")

        def ptr_attrs(attrs_p, ptr):
            attrs_p._obj.type, attrs_p._obj.device = self.mem_type, self.device
            return ret("pointer_get_attributes")

        def dev_ptr(ptr_p, host, flags):
            ptr_p._obj.value = host
            return ret("host_get_device_pointer")

        def clear():
            self.last_error_cleared += 1
            return 0

        return uva._UvaRuntime(
            host_get_device_pointer=dev_ptr, pointer_get_attributes=ptr_attrs, device_get_attribute=get_attr,
            host_register=lambda p, n, f: ret("host_register"), host_unregister=lambda p: ret("host_unregister"),
            get_last_error=clear, get_error_name=lambda err: b"cudaErrorInvalidValue",
        )


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(uva, "_runtime", lambda: rt.runtime())
    monkeypatch.setattr(uva.torch.cuda, "device", lambda dev: _NullContext())
    return rt


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_device_pointer_returns_the_runtime_address_when_every_call_succeeds(fake):
    host = torch.zeros(8, dtype=torch.uint8)
    assert uva.device_pointer(host, torch.device("cuda", 0)) == host.data_ptr()
    assert fake.last_error_cleared == 0


@pytest.mark.parametrize("failing", ["device_get_attribute", "pointer_get_attributes", "host_get_device_pointer"])
def test_a_failed_runtime_call_raises_uva_error_and_clears_the_last_error(fake, failing):
    fake.errors[failing] = 1
    with pytest.raises(uva.UvaError, match="cudaErrorInvalidValue") as info:
        uva.device_pointer(torch.zeros(8, dtype=torch.uint8), torch.device("cuda", 0))
    assert info.value.code == 1 and fake.last_error_cleared == 1


def test_a_gpu_that_cannot_map_host_memory_is_a_named_error(fake):
    fake.can_map = 0
    with pytest.raises(uva.UvaError, match="cannot map host memory"):
        uva.device_pointer(torch.zeros(8, dtype=torch.uint8), torch.device("cuda", 0))


def test_unregistered_memory_is_refused_naming_the_fix(fake):
    fake.mem_type = 0  # cudaMemoryTypeUnregistered
    with pytest.raises(uva.UvaError, match="pin_mapped"):
        uva.device_pointer(torch.zeros(8, dtype=torch.uint8), torch.device("cuda", 0))


def test_memory_registered_under_another_device_is_refused_before_torch_would_copy_it(fake):
    fake.device = 1
    with pytest.raises(uva.UvaError, match="set_device"):
        uva.device_pointer(torch.zeros(8, dtype=torch.uint8), torch.device("cuda", 0))


def test_registration_failure_is_a_uva_error(fake, monkeypatch):
    monkeypatch.setattr(uva.torch.cuda, "is_available", lambda: True)
    fake.errors["host_register"] = 2
    with pytest.raises(uva.UvaError, match="cannot map host memory"):
        uva.pin_mapped(torch.zeros(8, dtype=torch.uint8))
    assert fake.last_error_cleared == 1


def test_pointer_attributes_buffer_is_at_least_the_cuda_12_struct():
    # type, device, devicePointer, hostPointer, long reserved[8] = 56 bytes in CUDA 12.x
    assert ctypes.sizeof(uva._PointerAttributes) >= 56


def test_register_flags_are_mapped_and_portable():
    assert uva.HOST_REGISTER_FLAGS == 3  # cudaHostRegisterPortable (1) | cudaHostRegisterMapped (2)


def test_store_device_rows_on_cpu_are_the_host_rows(tiny_ckpt):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    layer = store.layers[0]
    assert store.device_rows(layer, "cpu") is store.rows(layer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_store_device_rows_on_cuda_without_pinning_is_a_named_error(tiny_ckpt):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    with pytest.raises(uva.UvaError, match="pin=True"):
        store.device_rows(store.layers[0], "cuda:0")
