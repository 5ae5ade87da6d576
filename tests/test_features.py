"""Fine-tuning features on disk: save_features' .npz read back memory-mapped, equal to numpy's own reading."""
import zipfile

import numpy as np
import pytest

from workflow.cli import UserError
from workflow.data.features import load_features, save_features

FEATURES = {
    "input_ids": np.arange(6 * 384, dtype=np.int32).reshape(6, 384),
    "offsets": np.arange(6 * 384 * 2, dtype=np.int64).reshape(6, 384, 2),
    "labels": np.asarray([0.5, 1.25, -3.0, 0.0, 2.0, 4.5], dtype=np.float32),
    "example_ids": np.asarray(["56be4db0acb8001400a502ec", "q2", "ü-3", "4", "5", "6"]),
    "fortran": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
    "empty": np.zeros((0, 384), dtype=np.int32),
}


def test_features_are_memory_mapped_copy_on_write_and_equal_numpys_reading(tmp_path):
    path = tmp_path / "features.npz"
    save_features(path, FEATURES)
    loaded = load_features(path)
    with np.load(path) as reference:
        assert sorted(loaded) == sorted(reference.files) == sorted(FEATURES)
        for name, array in loaded.items():
            assert array.dtype == reference[name].dtype and np.array_equal(array, reference[name]), name
    assert all(isinstance(loaded[name], np.memmap) for name in FEATURES if name != "empty")
    loaded["input_ids"][0, 0] = -1  # copy-on-write: the file keeps its bytes
    assert load_features(path)["input_ids"][0, 0] == 0


def test_a_compressed_npz_is_read_into_memory(tmp_path):
    path = tmp_path / "compressed.npz"
    np.savez_compressed(path, **FEATURES)
    loaded = load_features(path)
    assert all(np.array_equal(loaded[name], FEATURES[name]) for name in FEATURES)
    assert not any(isinstance(array, np.memmap) for array in loaded.values())


@pytest.mark.parametrize("damage", ["truncated", "not a zip"])
def test_a_damaged_features_file_is_one_error_naming_it(tmp_path, damage):
    path = tmp_path / "features.npz"
    save_features(path, FEATURES)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a zip at all")
    with pytest.raises(UserError, match=rf"^{path}: cannot read features: "):
        load_features(path)
    assert zipfile.is_zipfile(path) is False
