"""GGUF's quantized tensor types dequantized with torch: each kernel maps the raw bytes of
a tensor (flat uint8) to its values (flat), block by block, mirroring
`gguf.quants.<TYPE>.dequantize_blocks` op for op so results are identical (and several
times faster)."""

import gguf
import torch
from gguf import GGMLQuantizationType as QT

QK_K = 256  # values per K-quant super-block
_NIBBLE_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8)


def _blocks(raw: torch.Tensor, qtype: QT) -> torch.Tensor:
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return raw.reshape(-1, type_size)  # (n_blocks, type_size)


def _f16(column: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) float32."""
    return column.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """(n, k*width) bytes -> (n, 2k, width): per group of `width` bytes, low then high nibbles."""
    groups = qs.reshape(qs.shape[0], -1, 1, width) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)
    return (groups & 0x0F).reshape(qs.shape[0], -1, width)


def _bits(qh: torch.Tensor, shifts: list[int], mask: int, width: int) -> torch.Tensor:
    """(n, k*width) bytes -> (n, k*len(shifts), width): fields at `shifts` of each byte."""
    shift = torch.tensor(shifts, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return ((qh.reshape(qh.shape[0], -1, 1, width) >> shift) & mask).reshape(qh.shape[0], -1, width)


def _dequant_q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q4_0)
    d, qs = _f16(blocks[:, :2]), _nibbles(blocks[:, 2:], 16).reshape(len(blocks), -1)
    return (d * (qs.to(torch.int8) - 8).float()).reshape(-1)


def _dequant_q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q4_1)
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    qs = _nibbles(blocks[:, 4:], 16).reshape(len(blocks), -1).float()
    return qs.mul_(d).add_(m).reshape(-1)  # in place: d * qs + m


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 (n, 32) uint8 values: 4 low bits from `qs`, the 5th from 32-bit `qh`."""
    high = _bits(qh, list(range(8)), 0x01, 1).reshape(len(qh), 32)  # bit j of the LE uint32
    return _nibbles(qs, 16).reshape(len(qs), -1) | (high << 4)


def _dequant_q5_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q5_0)
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:])
    return (_f16(blocks[:, :2]) * (q.to(torch.int8) - 16).float()).reshape(-1)


def _dequant_q5_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q5_1)
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:]).float()
    return (d * q + m).reshape(-1)


def _dequant_q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q8_0)
    x = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (x * _f16(blocks[:, :2])).reshape(-1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: unpack 12 bytes into 8 six-bit scales and 8 six-bit mins, (n, 8) each."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scaled(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: apply the 8 sub-block scales and mins to q (n, 8, 32)."""
    sc, mn = _k_scale_min(blocks[:, 4:16])
    d = (_f16(blocks[:, :2]) * sc.float()).reshape(-1, 8, 1)
    dm = (_f16(blocks[:, 2:4]) * mn.float()).reshape(-1, 8, 1)
    return (d * q.float() - dm).reshape(-1)


def _dequant_q4_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q4_K)
    return _k_scaled(blocks, _nibbles(blocks[:, 16:], 32))


def _dequant_q5_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q5_K)
    high = _bits(blocks[:, 16:48], list(range(8)), 0x01, 32)
    return _k_scaled(blocks, _nibbles(blocks[:, 48:], 32) | (high << 4))


def _dequant_q6_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q6_K)
    n = len(blocks)
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks[:, 208:]) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = _bits(qh, [0, 2, 4, 6], 0x03, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (d * q).reshape(-1)


def _dequant_q2_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q2_K)
    n = len(blocks)
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, QK_K // 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, QK_K // 16, 1)
    q = _bits(qs, [0, 2, 4, 6], 0x03, 32).reshape(n, QK_K // 16, 16).float()
    return (dl * q - ml).reshape(-1)


def _dequant_q3_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.Q3_K)
    n = len(blocks)
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], blocks[:, 108:]
    # 16 six-bit scales: low nibbles from bytes 0-7, two high bits each from bytes 8-11
    low = _bits(packed[:, :8], [0, 4], 0x0F, 8).reshape(n, 16)
    high = _bits(packed[:, 8:], [0, 2, 4, 6], 0x03, 4).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(d) * scales).reshape(n, 16, 1)
    ql = _bits(qs, [0, 2, 4, 6], 0x03, 32).reshape(n, 16, QK_K // 16)
    qh = _bits(hmask, list(range(8)), 0x01, 32).reshape(n, 16, QK_K // 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()  # a set mask bit: no offset
    return (dl * q).reshape(-1)


# IQ4's sixteen non-linear levels (gguf.quants.IQ4_NL.kvalues)
IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                           89, 113], dtype=torch.int8)


def _dequant_iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.IQ4_NL)
    codes = _nibbles(blocks[:, 2:], 16).reshape(len(blocks), -1).long()
    return (_f16(blocks[:, :2]) * IQ4_LEVELS[codes].float()).reshape(-1)


def _dequant_iq4_xs(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, QT.IQ4_XS)
    n = len(blocks)
    d = _f16(blocks[:, :2])
    high16 = blocks[:, 2].int() | (blocks[:, 3].int() << 8)  # a little-endian uint16
    shifts = torch.arange(0, 16, 2, dtype=torch.int32)
    high = ((high16.reshape(n, 1) >> shifts) & 0x03).to(torch.uint8)  # (n, 8)
    low = _bits(blocks[:, 4:8], [0, 4], 0x0F, 1).reshape(n, 8)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, -1, 1)
    codes = _nibbles(blocks[:, 8:], 16).reshape(n, 8, 32).long()
    return (dl * IQ4_LEVELS[codes].float()).reshape(-1)


DEQUANTIZERS = {
    QT.F32: lambda raw: raw.view(torch.float32),
    QT.F16: lambda raw: raw.view(torch.float16),
    QT.BF16: lambda raw: raw.view(torch.bfloat16),
    QT.Q4_0: _dequant_q4_0,
    QT.Q4_1: _dequant_q4_1,
    QT.Q5_0: _dequant_q5_0,
    QT.Q5_1: _dequant_q5_1,
    QT.Q8_0: _dequant_q8_0,
    QT.Q4_K: _dequant_q4_k,
    QT.Q5_K: _dequant_q5_k,
    QT.Q6_K: _dequant_q6_k,
    QT.Q2_K: _dequant_q2_k,
    QT.Q3_K: _dequant_q3_k,
    QT.IQ4_NL: _dequant_iq4_nl,
    QT.IQ4_XS: _dequant_iq4_xs,
}
