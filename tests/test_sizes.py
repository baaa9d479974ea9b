import pytest

from specter.sizes import format_size, parse_size

GiB, MiB, KiB = 2**30, 2**20, 2**10


@pytest.mark.parametrize("text, nbytes", [
    ("6GiB", 6 * GiB),
    ("512MiB", 512 * MiB),
    ("1.5GB", 1_500_000_000),
    ("300MB", 300_000_000),
    ("1024", 1024),
    (1024, 1024),
    (0, 0),
    ("0", 0),
    ("6 GiB", 6 * GiB),
    ("  512 mib ", 512 * MiB),
    ("6gib", 6 * GiB),
    ("6GIB", 6 * GiB),
    ("1.5GiB", 3 * GiB // 2),
    ("0.5KiB", 512),
    (".5 KiB", 512),
    ("4KiB", 4 * KiB),
    ("4kb", 4000),
    ("2TiB", 2 * 2**40),
    ("2TB", 2 * 10**12),
    ("12B", 12),
    ("12 b", 12),
    ("1.", 1),
    ("0.1KiB", 102),               # with a unit, whole bytes down (a natural budget: 10.1GiB)
    ("10.1GiB", 10844792422),
])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes
    assert type(parse_size(text)) is int


@pytest.mark.parametrize("bad", [
    "", "   ", "GiB", "6 GiBs", "6G", "6 gigabytes", "-1GiB", "1e9", "1,024", "6 Gi B", "1.5 B",
    "1.5", -1, 1.5, None, True, "6GiB6", "\u0967\u0968", "\uff16GiB",  # (non-ASCII digits: Devanagari 12, fullwidth 6)
])
def test_parse_size_errors(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad)
    if isinstance(bad, str) and bad.strip() and "B" in bad.upper() and "." not in bad and "-" not in bad:
        assert "GiB" in str(info.value) and "GB" in str(info.value)  # names the accepted forms


@pytest.mark.parametrize("bad", ["-1", " -1GiB", -6])
def test_a_negative_size_says_so_as_a_string_or_a_number(bad):
    with pytest.raises(ValueError, match="must not be negative"):  # "-1" said "cannot parse", -6 this
        parse_size(bad)


def test_numpy_integers_are_sizes():
    np = pytest.importorskip("numpy")
    assert parse_size(np.int64(4096)) == 4096 and type(parse_size(np.int32(7))) is int


def test_error_message_names_accepted_forms():
    with pytest.raises(ValueError, match=r"KiB/MiB/GiB.*KB/MB/GB"):
        parse_size("six gigs")


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"),
    (12, "12 B"),
    (1023, "1023 B"),
    (1024, "1.00 KiB"),
    (1536, "1.50 KiB"),
    (512 * MiB, "512.0 MiB"),
    (6 * GiB, "6.00 GiB"),
    (40 * GiB, "40.0 GiB"),
    (1024 * MiB - 1, "1.00 GiB"),
    (3 * 2**40, "3.00 TiB"),
    (5000 * 2**40, "5000.0 TiB"),
    (-2048, "-2.00 KiB"),
])
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


@pytest.mark.parametrize("nbytes", [1, 999, 4096, 7 * MiB, 6 * GiB, 123 * GiB])
def test_roundtrip_close(nbytes):
    value, unit = format_size(nbytes).split()
    assert abs(parse_size(f"{value}{unit}" if unit != "B" else value) - nbytes) <= nbytes * 0.01
