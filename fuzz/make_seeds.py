#!/usr/bin/env python3
"""Writes a small seed corpus for the gguf_reader fuzz target.

Each seed is a shrunken copy of a shipped GGUF, written by gguf-py (an
independent writer): the same metadata keys and value types with arrays cut
to a few elements, and up to three tensors cut to at most two rows. Small
seeds keep libFuzzer fast while covering the real files' structure.

usage: fuzz/make_seeds.py [OUT_DIR]   (default fuzz/corpus/gguf_reader)
"""
import sys
from pathlib import Path

import numpy as np
import gguf

FUZZ = Path(__file__).resolve().parent
TESTDATA = FUZZ.parent.parent / "shared" / "testdata"
SOURCES = [
    FUZZ.parent / "models" / "stories260K.gguf",
    TESTDATA / "models" / "stories260K-F16.gguf",
    TESTDATA / "models" / "tiny-llama-Q4_K.gguf",
    TESTDATA / "models" / "tiny-llama-Q1_0.gguf",
    TESTDATA / "models" / "tiny-llama-TQ1_0.gguf",
    TESTDATA / "models" / "tiny-qwen3-Q6_K.gguf",
    TESTDATA / "tokenizer" / "ggml-vocab-bert-bge.gguf",
    TESTDATA / "tokenizer" / "ggml-vocab-gpt-2.gguf",
]
MAX_ARRAY = 6
MAX_ROWS = 2


def shrink(src: Path, dst: Path) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY:
            value = value[:MAX_ARRAY]
            sub = field.types[1]
        writer.add_key_value(key, value, vtype, sub_type=sub)
    # The smallest tensors plus the first quantized one, cut to MAX_ROWS rows.
    tensors = sorted(reader.tensors, key=lambda t: t.n_bytes)[:2]
    quantized = [t for t in reader.tensors if t.tensor_type not in (gguf.GGMLQuantizationType.F32,)]
    tensors += quantized[:1]
    for t in tensors:
        shape = [int(d) for d in t.shape]  # ne order: shape[0] is the row length
        n_rows = int(np.prod(shape[1:]))
        row_bytes = t.n_bytes // n_rows
        rows = min(MAX_ROWS, n_rows)
        # uint8 rows of raw bytes: gguf-py turns the byte shape back into elements.
        raw = np.frombuffer(t.data.tobytes()[: rows * row_bytes], dtype=np.uint8)
        raw = raw.reshape(rows, row_bytes) if len(shape) > 1 else raw
        writer.add_tensor(t.name, raw, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def every_value_type(dst: Path) -> None:
    """One key of each value type, nested arrays included, and two tiny tensors."""
    T = gguf.GGUFValueType
    writer = gguf.GGUFWriter(dst, "llama")
    writer.add_custom_alignment(64)
    for i, (vtype, value) in enumerate([
        (T.UINT8, 200), (T.INT8, -100), (T.UINT16, 60000), (T.INT16, -30000),
        (T.UINT32, 4_000_000_000), (T.INT32, -2_000_000_000), (T.FLOAT32, 1.5),
        (T.BOOL, True), (T.STRING, "h\u00e9llo"), (T.UINT64, 2**64 - 1),
        (T.INT64, -2**63), (T.FLOAT64, 3.25),
    ]):
        writer.add_key_value(f"t.{i}", value, vtype)
    writer.add_key_value("t.strings", ["a", "", "b"], T.ARRAY, sub_type=T.STRING)
    writer.add_key_value("t.nested", [[1, 2], [3]], T.ARRAY, sub_type=T.ARRAY)
    writer.add_tensor("a", np.arange(8, dtype=np.float32))
    writer.add_tensor("b", np.arange(6, dtype=np.float16).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else FUZZ / "corpus" / "gguf_reader"
    out.mkdir(parents=True, exist_ok=True)
    for src in SOURCES:
        dst = out / f"seed-{src.stem}.gguf"
        shrink(src, dst)
        print(f"{dst} {dst.stat().st_size} bytes")
    dst = out / "seed-every-value-type.gguf"
    every_value_type(dst)
    print(f"{dst} {dst.stat().st_size} bytes")


if __name__ == "__main__":
    main()
