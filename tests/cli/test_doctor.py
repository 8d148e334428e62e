"""qkv doctor's line on the paged pools' memory (huge pages where Linux has them), read from
the kernel's transparent huge page setting."""


def test_doctor_says_where_pools_lie(tmp_path, monkeypatch):
    from qkv.cli import doctor

    for text, says in (
        (
            "always [madvise] never\n",
            "large ones on 2 MiB huge pages (transparent huge pages: madvise)",
        ),
        ("always madvise [never]\n", "4 KiB pages (transparent huge pages: never)"),
    ):
        (tmp_path / "enabled").write_text(text)
        monkeypatch.setattr(doctor, "THP", tmp_path / "enabled")
        assert doctor.pool_pages() == says
    monkeypatch.setattr(doctor, "THP", tmp_path / "absent")
    assert doctor.pool_pages() == "4 KiB pages (no transparent huge pages here)"
