"""common.data.prepare: the data set checked and shrunk once, trusted after a cheap check, never half-written."""

import json
import multiprocessing
import os
import shutil

import numpy as np
import pytest

from common.data import chestxray, prepare
from common.data.image_io import open_gray
from common.errors import InputError

SIZE = 24


def image_paths(folder) -> list[str]:
    return chestxray.locate_images(folder, chestxray.read_entries(folder)["Image Index"].tolist())


def test_a_prepared_copy_holds_every_image_shrunk_and_is_trusted_after_a_stat(standin_copy, monkeypatch):
    paths = image_paths(standin_copy)
    prepared = prepare.ensure(standin_copy, paths, SIZE, workers=2)
    assert prepared.folder == standin_copy / ".prepared" / f"{SIZE}px" and len(prepared.names) == len(paths)
    for row in (0, len(paths) - 1):
        np.testing.assert_array_equal(prepared.pixels(row), prepare.shrink(open_gray(paths[row]), SIZE))
    monkeypatch.setattr(prepare, "_build", lambda *args: pytest.fail("a valid copy was rebuilt"))
    assert prepare.ensure(standin_copy, paths, SIZE).names == prepared.names


def test_a_changed_image_or_another_size_is_prepared_again(standin_copy, capsys):
    paths = image_paths(standin_copy)
    prepare.ensure(standin_copy, paths, SIZE, workers=1)
    os.utime(paths[3], ns=(1, 1))  # a newer copy of the data set, say
    assert prepare.find(standin_copy, paths, SIZE) is None
    prepare.ensure(standin_copy, paths, SIZE, workers=1)
    assert "rebuilding" in capsys.readouterr().out and prepare.find(standin_copy, paths, SIZE) is not None
    assert prepare.find(standin_copy, paths, SIZE + 8) is None  # each size is a copy of its own


def test_an_unreadable_image_is_named_and_nothing_is_trusted_until_it_is_replaced(standin_copy, monkeypatch):
    paths = image_paths(standin_copy)
    good = open(paths[40], "rb").read()
    open(paths[40], "wb").write(good[: len(good) // 2])  # truncated
    with pytest.raises(InputError, match=f"(?s)1 image.*not prepared.*{os.path.basename(paths[40])} .*truncated"):
        prepare.ensure(standin_copy, paths, SIZE, workers=2)
    folder = prepare.folder_for(standin_copy, SIZE)
    assert not (folder / prepare.MANIFEST).exists() and prepare.find(standin_copy, paths, SIZE) is None
    # the chunks that were fine are kept, so a second attempt redoes only the one with the bad image
    assert len(list((folder / "done").iterdir())) == len(range(0, len(paths), prepare.chunk_size(len(paths)))) - 1
    open(paths[40], "wb").write(good)
    assert prepare.ensure(standin_copy, paths, SIZE, workers=2).pixels(40).shape == (SIZE, SIZE)


def test_an_interrupted_prepare_of_another_data_set_is_not_resumed(standin_copy):
    paths = image_paths(standin_copy)
    folder = prepare.folder_for(standin_copy, SIZE)
    (folder / "done").mkdir(parents=True)
    (folder / "plan.json").write_text(json.dumps({"names": ["other.png"]}))
    (folder / "done" / f"{0:09d}").touch()  # a chunk "finished" for other files must not be taken for this one
    prepared = prepare.ensure(standin_copy, paths, SIZE, workers=1)
    np.testing.assert_array_equal(prepared.pixels(0), prepare.shrink(open_gray(paths[0]), SIZE))


def prepare_in_a_process(folder, paths, queue):
    queue.put(prepare.ensure(folder, paths, SIZE, workers=1).names)


def test_two_prepares_at_once_take_turns_and_agree(standin_copy):
    paths, queue = image_paths(standin_copy), multiprocessing.get_context("spawn").Queue()
    context = multiprocessing.get_context("spawn")
    both = [context.Process(target=prepare_in_a_process, args=(standin_copy, paths, queue)) for _ in range(2)]
    for process in both:
        process.start()
    for process in both:
        process.join(120)
    assert [process.exitcode for process in both] == [0, 0]
    assert queue.get(timeout=5) == queue.get(timeout=5) and prepare.find(standin_copy, paths, SIZE) is not None


def test_too_little_disk_space_is_refused_before_writing(standin_copy, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**6, 10**6, 100))
    with pytest.raises(InputError, match="GiB free: free some space, or set PREPARED=False"):
        prepare.ensure(standin_copy, image_paths(standin_copy), SIZE)
    assert not (prepare.folder_for(standin_copy, SIZE) / "images.u8").exists()


def test_a_read_only_data_folder_is_prepared_in_the_users_cache(standin_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("CHESTXRAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert prepare.folder_for(standin_copy, SIZE).is_relative_to(tmp_path / "cache" / "prepared")


def test_the_splits_read_the_prepared_copy_and_a_training_process_only_opens_it(standin_copy):
    with pytest.raises(InputError, match="(?s)no valid prepared copy at 24 px.*make prepare"):
        chestxray.load(standin_copy, check=False, prepared_size=SIZE)
    splits = chestxray.load(standin_copy, prepared_size=SIZE)
    opened = chestxray.load(standin_copy, check=False, prepared_size=SIZE)
    test = splits["test"]
    assert test.prepared is not None and list(opened["test"].rows) == list(test.rows)
    np.testing.assert_array_equal(test.pixels(2), prepare.shrink(open_gray(test.paths[2]), SIZE))
    assert chestxray.load(standin_copy)["test"].pixels(2).shape == (32, 32)  # without: the PNG itself


def test_unprepared_splits_decode_each_png_and_give_the_prepared_pixels_without_making_a_copy(standin_copy):
    """PREPARED=False: the same pixels as the copy (the same crops follow from them), at a decode per read."""
    decoded = chestxray.load(standin_copy, prepared_size=SIZE, prepared=False)["test"]
    assert decoded.prepared is None and not prepare.folder_for(standin_copy, SIZE).exists()
    prepared = chestxray.load(standin_copy, prepared_size=SIZE)["test"]
    for index in (0, 2, len(decoded) - 1):
        np.testing.assert_array_equal(decoded.pixels(index), prepared.pixels(index))
    assert decoded.pixels(0).flags.writeable, "a tensor made from it without a copy may be written"


def test_a_prepared_copy_cut_short_is_rebuilt_with_a_message_and_refused_to_a_training_process(standin_copy, capsys):
    """A full disk or a copy killed midway: trusted, it killed training with 'mmap length is greater than file size'."""
    paths = image_paths(standin_copy)
    prepared = prepare.ensure(standin_copy, paths, SIZE, workers=1)
    images = prepared.folder / "images.u8"
    os.truncate(images, images.stat().st_size // 2)
    assert prepare.find(standin_copy, paths, SIZE) is None
    with pytest.raises(InputError, match="no valid prepared copy"):  # a launched process only opens the copy
        chestxray.load(standin_copy, None, 0, check=False, prepared_size=SIZE)
    capsys.readouterr()
    rebuilt = prepare.ensure(standin_copy, paths, SIZE, workers=1)
    assert f"images.u8 holds {len(paths) * SIZE * SIZE // 2:,} bytes" in capsys.readouterr().out
    np.testing.assert_array_equal(rebuilt.pixels(len(paths) - 1), prepare.shrink(open_gray(paths[-1]), SIZE))


def test_make_prepare_checks_every_pixel_and_prepares_again_the_chunks_that_differ(standin_copy, capsys):
    """A copy moved between disks keeps its length but not always its bytes: only the digests written at prepare time
    tell; the cheap check that every notebook runs does not read the pixels."""
    paths = image_paths(standin_copy)
    prepared = prepare.ensure(standin_copy, paths, SIZE, workers=1)
    row = len(paths) - 2
    pixels = np.memmap(prepared.folder / "images.u8", np.uint8, "r+", shape=(len(paths), SIZE, SIZE))
    pixels[row] = 255 - pixels[row]
    pixels.flush()
    assert prepare.find(standin_copy, paths, SIZE) is not None  # the cheap check cannot see it
    capsys.readouterr()
    checked = prepare.ensure(standin_copy, paths, SIZE, workers=1, verify=True)
    chunk = prepare.chunk_size(len(paths))
    assert (
        f"differs from the digests it was prepared with in 1 chunk(s) of {chunk} images (rows {row // chunk * chunk})"
        in (capsys.readouterr().out)
    )
    np.testing.assert_array_equal(checked.pixels(row), prepare.shrink(open_gray(paths[row]), SIZE))
    assert not prepare._differing_chunks(checked.folder, len(paths), SIZE)
