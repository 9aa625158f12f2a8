"""The binding (kernels/binding.py) against the C ABI (kernels.h), and the refusal of a
library it cannot call: another ABI, a function missing."""

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

from llmserve import cpu_info
from llmserve.kernels import native
from llmserve.kernels.binding import ABI, HEADER, SIGNATURES, IncompatibleLibrary, Kernels

_SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def _ctype(c_type: str, returned: bool = False) -> type | None:
    c_type = " ".join(c_type.split())
    if c_type == "void":
        return None
    if returned and c_type == "const char*":
        return ctypes.c_char_p
    return ctypes.c_void_p if "*" in c_type else _SCALARS[c_type]


def header_signatures() -> dict[str, tuple[list[type], type | None]]:
    """name (without llmserve_) -> (argtypes, restype) of every function kernels.h declares."""
    declared = re.findall(r"^([\w ]+\**) *\bllmserve_(\w+)\(([^)]*)\);", HEADER.read_text(),
                          re.MULTILINE)
    signatures = {}
    for returned, name, params in declared:
        types = [re.fullmatch(r"(.+?)\s*\w+", p.strip()).group(1) for p in params.split(",")
                 if p.strip()]
        signatures[name] = ([_ctype(t) for t in types], _ctype(returned, returned=True))
    return signatures


def test_binding_declares_every_function_of_the_header_with_its_types():
    header = header_signatures()
    assert len(header) == 35, sorted(header)  # the parse found every declaration
    assert sorted(SIGNATURES) == sorted(header)
    for name, (argtypes, restype) in header.items():
        assert SIGNATURES[name] == (argtypes, restype), name


def test_header_abi_is_the_one_number():
    text = HEADER.read_text()
    assert re.findall(r"#define LLMSERVE_KERNELS_ABI (\d+)", text) == [str(ABI)]
    api = (HEADER.parent / "kernels_api.cpp").read_text()
    assert "llmserve_kernels_abi() { return LLMSERVE_KERNELS_ABI; }" in api


def _build(tmp_path: Path, source: str) -> Path:
    compiler = cpu_info.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    cpp = tmp_path / "fake_kernels.cpp"
    cpp.write_text(source)
    target = tmp_path / f"fake_kernels{cpu_info.shared_library_suffix()}"
    subprocess.run([compiler, "-shared", "-fPIC", str(cpp), "-o", str(target)], check=True,
                   capture_output=True, timeout=60)
    return target


def test_library_of_another_abi_is_refused_by_name(tmp_path):
    path = _build(tmp_path, '#include <cstdint>\n'
                            'extern "C" int32_t llmserve_kernels_abi() { return 1; }\n')
    with pytest.raises(IncompatibleLibrary) as refused:
        Kernels(ctypes.CDLL(str(path)), path)
    message = str(refused.value)
    print(message)
    assert message.startswith(f"{path}: its ABI is 1, this llmserve's is {ABI} ")


def test_library_lacking_a_function_is_refused_naming_it(tmp_path):
    stubs = "".join(f'extern "C" void llmserve_{name}() {{}}\n' for name in SIGNATURES
                    if name not in ("kernels_abi", "rms_norm"))
    path = _build(tmp_path, '#include <cstdint>\n'
                            f'extern "C" int32_t llmserve_kernels_abi() {{ return {ABI}; }}\n'
                            + stubs)
    with pytest.raises(IncompatibleLibrary) as refused:
        Kernels(ctypes.CDLL(str(path)), path)
    message = str(refused.value)
    print(message)
    assert message == (f"{path}: its ABI is {ABI}, but it lacks llmserve_rms_norm, which "
                       f"kernels.h declares")


def test_loaded_library_answers_the_header_abi():
    lib = native()
    if lib is None:
        pytest.skip("no native kernels here")
    define = re.search(r"#define LLMSERVE_KERNELS_ABI (\d+)", HEADER.read_text())
    assert lib.kernels_abi() == int(define.group(1))
    assert lib.path.exists()
