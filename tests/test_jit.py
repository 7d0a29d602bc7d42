"""mok_cute.jit: registry, compile cache, PTX/ptxas/SASS inspection and diffs. No GPU needed."""

import json
import re
import sys
import textwrap

import pytest

from mok_cute import jit

ARCH = "sm_90a"


def _available_or_skip(name: str) -> None:
    status = jit.kernel_status(name)
    if status is None:
        return
    if status.startswith("missing"):
        pytest.skip(f"{name}: {status}")
    pytest.fail(f"{name}: {status}")


@pytest.fixture(scope="session")
def ptx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ptx")


@pytest.fixture(scope="session")
def reports(ptx_dir):
    """inspect_kernel results with the registered defaults, compiled once per session."""
    cache = {}

    def get(name: str, arch: str = ARCH):
        if (name, arch) not in cache:
            _available_or_skip(name)
            cache[name, arch] = jit.inspect_kernel(name, arch, ptx_dir)
        return cache[name, arch]

    return get


# ------------------------------------------------------------------ every registered kernel
@pytest.mark.parametrize("name", list(jit.KERNELS))
def test_registered_kernel_compiles_for_sm90a_without_spills(name, reports):
    rep = reports(name)
    ptx = open(rep.ptx_path).read()
    assert re.search(r"^\.target sm_90a", ptx, re.M)
    assert ".entry" in ptx
    assert open(rep.cubin_path, "rb").read(4) == b"\x7fELF"
    assert rep.kernels, "ptxas report was not captured"
    assert rep.registers and rep.registers > 0
    assert rep.spill_bytes == 0, [k.__dict__ for k in rep.kernels]
    assert not [w for w in rep.warnings if "C7508" in w], rep.warnings
    assert rep.mix["multimem"] == 0, "NVLink multicast is not allowed anywhere (DESIGN)"
    assert rep.launches and all(l["block"][0] > 0 for l in rep.launches)


@pytest.mark.parametrize("name", ["gather_rows", "scatter_rows", "weighted_ksum"])
def test_token_ops_move_rows_as_16_byte_vectors(name, reports):
    rep = reports(name)
    assert rep.mix["ld.global.128b"] > 0 and rep.mix["st.global.128b"] > 0
    # bf16 row data never moves in narrower pieces; 32-bit loads are the index / weights.
    for narrow in ("ld.global.16b", "ld.global.64b", "st.global.16b", "st.global.32b", "st.global.64b"):
        assert rep.mix[narrow] == 0, (narrow, rep.mix)
    for forbidden in ("atom", "red", "ld.local/st.local"):
        assert rep.mix[forbidden] == 0, (forbidden, rep.mix)
    assert rep.warnings == []


def test_scatter_rows_reads_a_row_once_and_writes_it_k_times(reports):
    rep = reports("scatter_rows")
    k = rep.static["K"]
    # one index load per k; per vector step, each 16-byte load is stored once per k
    assert rep.mix["ld.global.32b"] == k
    assert rep.mix["st.global.128b"] == k * rep.mix["ld.global.128b"]


def test_weighted_ksum_rounds_product_then_sum_without_fma(reports):
    rep = reports("weighted_ksum")
    ptx = open(rep.ptx_path).read()
    assert rep.mix["fma.f32"] == 0
    k = rep.static["K"]
    # one weight load per k, and one 16-byte load per k (plus the shared row) per vector step
    assert rep.mix["ld.global.32b"] == k
    assert rep.mix["ld.global.128b"] % (k + 1) == 0
    assert ptx.count("mul.rn.f32") == ptx.count("add.rn.f32") >= 8 * k


def test_token_ops_compile_offline_for_sm100a(ptx_dir):
    for name in ("gather_rows", "scatter_rows", "weighted_ksum"):
        rep = jit.inspect_kernel(name, "sm_100a", ptx_dir)
        assert rep.arch == "sm_100a"
        assert re.search(r"^\.target sm_100a", open(rep.ptx_path).read(), re.M)
        assert rep.spill_bytes == 0


def test_gemm_reports_dynamic_smem(reports):
    if "gemm_fc1" not in jit.KERNELS:
        pytest.skip("gemm_fc1 is not registered")
    rep = reports("gemm_fc1")
    assert rep.mix["wgmma"] > 0 and rep.mix["tma.load"] > 0 and rep.mix["setmaxnreg"] > 0
    # the launch's dynamic smem is resolved from the host code; the GEMM stages need > 64 KiB
    assert rep.dynamic_smem and rep.dynamic_smem > 64 * 1024
    assert rep.smem_bytes >= rep.dynamic_smem


# ------------------------------------------------------------------ cache, report, diff
def test_compile_cache_returns_the_same_object():
    a = jit.compile_kernel("gather_rows", ARCH)
    b = jit.compile_kernel("gather_rows", ARCH)
    assert a is b
    defaults = dict(jit.KERNELS["weighted_ksum"].static)
    c = jit.compile_kernel("weighted_ksum", ARCH)
    assert jit.compile_kernel("weighted_ksum", ARCH, **defaults) is c
    other = {**defaults, "K": 3}
    assert jit.compile_kernel("weighted_ksum", ARCH, **other) is not c


def test_config_tag_stays_a_valid_file_name():
    """Many non-default static settings (the megakernel's switches) once made an artifact name
    longer than the file system's 255 bytes: the tag keeps a readable head and a digest, and
    two configurations that share the head still differ."""
    spec = jit.KERNELS["megakernel"]
    many = {f"switch_{i:02d}_with_a_long_name": True for i in range(20)}
    tags = [jit._config_tag(spec, dict(many, zz_last=v)) for v in (1, 2)]
    assert all(len(t) <= jit.MAX_TAG_CHARS + 1 for t in tags) and tags[0] != tags[1]
    assert tags[0].startswith(".switch_00_with_a_long_nameTrue")
    short = jit._config_tag(spec, {"top_k": 4})
    assert short == ".top_k4"


def test_inspect_report_fields_and_files(reports, ptx_dir):
    rep = reports("gather_rows")
    assert rep.name == "gather_rows" and rep.arch == ARCH
    assert rep.static == dict(jit.KERNELS["gather_rows"].static)
    assert rep.launches[0]["block"] == [128, 1, 1]
    assert rep.launches[0]["smem"] == 0
    assert rep.smem_bytes == 0
    assert rep.compile_seconds > 0
    assert "Used" in rep.ptxas_log and "registers" in rep.ptxas_log
    stored = json.loads((ptx_dir / "gather_rows.sm_90a.json").read_text())
    assert stored["registers"] == rep.registers and stored["mix"] == rep.mix
    summary = rep.summary()
    for key in ("registers", "spill_bytes", "smem_bytes", "warnings", "wgmma", "ld.global.128b"):
        assert key in summary
    if rep.sass_path is None:
        assert rep.sass_note.startswith("SASS skipped")
    else:
        assert rep.sass_mix["LDG.128"] > 0


def test_diff_of_two_configs(reports, ptx_dir):
    a = reports("weighted_ksum")
    k_b = a.static["K"] // 2
    b = jit.inspect_kernel("weighted_ksum", ARCH, ptx_dir, K=k_b, has_shared=False)
    assert b.ptx_path != a.ptx_path  # the second config gets its own files
    rows = {r.field: r for r in jit.diff_reports(a, b)}
    assert rows["static:K"].a == a.static["K"] and rows["static:K"].b == k_b
    assert rows["static:K"].delta == k_b - a.static["K"]
    assert rows["static:has_shared"].delta is None  # booleans get no numeric delta
    assert rows["ld.global.32b"].a == a.static["K"] and rows["ld.global.32b"].b == k_b
    assert jit.diff_reports(a, a) == []


def test_diff_ignores_warning_line_numbers():
    def rep(warnings):
        return jit.PtxReport("k", ARCH, {}, {}, [], warnings, [], "", "", None, None, None, "", 0.0)

    same = jit.diff_reports(rep(["ptxas info : (C7519) x in around line 498 y"]),
                            rep(["ptxas info : (C7519) x in around line 475 y"]))
    assert same == []
    new = jit.diff_reports(rep([]), rep(["ptxas info : (C7508) setmaxnreg ignored"]))
    assert [(r.field, r.a, r.b) for r in new] == [
        ("warnings", 0, 1), ("warning", None, "ptxas info : (C7508) setmaxnreg ignored")]


# ------------------------------------------------------------------ parsers on known text
SYNTHETIC_PTX = textwrap.dedent("""\
    .version 8.8
    .target sm_90a
    .visible .entry k(
    \t.param .u64 p
    )
    {
    \t.reg .b32 %r<9>;
    $L__BB0_1:
    \twgmma.fence.sync.aligned;
    \twgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 1, 0, 0;
    \twgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 1, 0, 0;
    \tcp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3, %r4}], [%r5];
    \tcp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%rd1, {%r2, %r3, %r4}], [%r5];
    \tcp.async.bulk.commit_group;
    \tsetmaxnreg.dec.sync.aligned.u32 40;
    \t@%p1 ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];   // predicated 16-byte load
    \tld.global.v2.b64 {%rd3, %rd4}, [%rd1+16];
    \tld.global.b32 %r6, [%rd2];
    \t@!%p2 st.global.v4.b32 [%rd5], {%r1, %r2, %r3, %r4};
    \tst.global.b16 [%rd5], %rs1;
    \tmbarrier.try_wait.parity.shared::cta.b64 %p3, [%r5], %r6;
    \tatom.global.add.u32 %r7, [%rd6], 1;
    \tred.release.gpu.global.add.s32 [%rd6], 1;
    \tfence.proxy.async.shared::cta;
    \tbar.sync 1, 256;
    \tbarrier.sync 0;
    \tfma.rn.f32 %r8, %r1, %r2, %r3;
    \t// wgmma.mma_async in a comment does not count
    \tret;
    }
    """)


def test_instruction_mix_counts_known_ptx():
    mix = jit.instruction_mix(SYNTHETIC_PTX)
    expected = {
        "wgmma": 2, "wgmma.fence/commit/wait": 1, "tma.load": 1, "tma.store": 1, "bulk_copy": 0,
        "setmaxnreg": 1, "mbarrier": 1, "atom": 1, "red": 1, "fence": 1, "bar": 2, "fma.f32": 1,
        "ld.global.128b": 2, "ld.global.32b": 1, "st.global.128b": 1, "st.global.16b": 1,
        "multimem": 0, "tcgen05.mma": 0,
    }
    assert {k: mix[k] for k in expected} == expected


PTXAS_LOG = textwrap.dedent("""\
    \x1b[96mremark[ptxas info]:\x1b[0m ptxas output: ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine register count at entry.
    ptxas info    : 0 bytes gmem
    ptxas info    : Compiling entry function 'kern_a' for 'sm_90a'
    ptxas info    : Function properties for kern_a
    ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
    ptxas info    : Used 168 registers, used 2 barriers, 1024 bytes smem, 400 bytes cmem[0]
    ptxas info    : Compiling entry function 'kern_b' for 'sm_90a'
    ptxas info    : Function properties for kern_b
    ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 10 registers, used 0 barriers
    ptxas warning : Value of threads per SM for entry kern_b is out of range
    """)


def test_parse_ptxas_log():
    kernels, warnings = jit.parse_ptxas_log(PTXAS_LOG)
    assert [(k.name, k.registers, k.barriers, k.stack_frame, k.spill_stores, k.spill_loads, k.static_smem)
            for k in kernels] == [("kern_a", 168, 2, 16, 8, 4, 1024), ("kern_b", 10, 0, 0, 0, 0, 0)]
    assert len(warnings) == 2
    assert warnings[0].startswith("ptxas info : (C7508)")
    assert warnings[1].startswith("ptxas warning :")


def test_parse_ptxas_log_with_names_wrapped_by_the_spill_remark():
    """The DSL's "ptxas detected register spills" remark wraps the entry name onto the next
    line; the spill must still be counted (it was reported as unknown before)."""
    log = textwrap.dedent("""\
        remark[ptxas]: ptxas detected register spills
                  ptxas info    : Compiling entry function
                  'kern_c'
                  for 'sm_90a'
                  ptxas info    : Function properties for
                  kern_c
                  ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
                  ptxas info    : Used 168 registers, used 5 barriers, 8 bytes cumulative stack size
        """)
    kernels, _ = jit.parse_ptxas_log(log)
    assert [(k.name, k.registers, k.spill_stores, k.spill_loads) for k in kernels] == [("kern_c", 168, 4, 4)]


def test_sass_mix_counts_known_sass():
    sass = textwrap.dedent("""\
            /*0000*/                   LDC R1, c[0x0][0x28] ;
            /*0010*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;
            /*0020*/                   STG.E.128 desc[UR4][R6.64], R4 ;
            /*0030*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
            /*0040*/                   UTMALDG.3D [UR8], [UR4] ;
            /*0050*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;
            /*0060*/                   STL [R1], R4 ;
            /*0070*/                   LDG.E R8, desc[UR4][R2.64] ;
    """)
    mix = jit.sass_mix(sass)
    assert mix["LDG"] == 2 and mix["LDG.128"] == 1 and mix["STG.128"] == 1
    assert mix["HGMMA"] == 1 and mix["UTMALDG"] == 1 and mix["USETMAXREG"] == 1
    assert mix["STL"] == 1 and mix["LDL"] == 0


def test_launch_smem_from_host_ir():
    struct = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"
    ir = (f"    %21 = llvm.mlir.constant(230400 : i64) : i64\n"
          f"    %203 = llvm.getelementptr %197[0, 2] : (!llvm.ptr) -> !llvm.ptr, {struct}\n"
          f"    llvm.store %21, %203 : i64, !llvm.ptr\n")
    assert jit.launch_smem_from_host_ir(ir) == [230400]
    assert jit.launch_smem_from_host_ir("no launch here") == []


# ------------------------------------------------------------------ arch, registry
def test_normalize_arch():
    assert jit.normalize_arch("sm_90a") == "sm_90a"
    assert jit.normalize_arch("SM100A") == "sm_100a"
    assert jit.compile_options("sm_100a", "--keep-ptx") == "--gpu-arch sm_100a --keep-ptx"
    with pytest.raises(ValueError, match="arch"):
        jit.normalize_arch("hopper")
    with pytest.raises(TypeError, match="arch"):
        jit.normalize_arch(90)


def test_unknown_kernel_name_is_a_value_error():
    with pytest.raises(ValueError, match="kernel name must be one of"):
        jit.compile_kernel("no_such_kernel")


def test_missing_and_broken_modules_are_reported_not_raised(monkeypatch, tmp_path):
    (tmp_path / "mok_broken_kernel_mod.py").write_text("raise ImportError('boom while importing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(jit.KERNELS, "not_yet", jit.KernelSpec("mok_cute.kernels.not_written_yet", "compile_x"))
    monkeypatch.setitem(jit.KERNELS, "broken", jit.KernelSpec("mok_broken_kernel_mod", "compile_x"))
    assert jit.kernel_status("not_yet").startswith("missing")
    status = jit.kernel_status("broken")
    assert status.startswith("import failed") and "boom while importing" in status
    sys.modules.pop("mok_broken_kernel_mod", None)


def test_find_nvdisasm_answers_either_way():
    tool, note = jit.find_nvdisasm()
    if tool is None:
        assert note.startswith("SASS skipped")
    else:
        assert re.match(r"nvdisasm \d+\.\d+", note)
