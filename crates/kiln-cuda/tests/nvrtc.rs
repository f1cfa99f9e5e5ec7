//! Device-free tests: they need libnvrtc (CI installs the nvidia-cuda-nvrtc wheel and sources
//! scripts/nvrtc-env.sh) but no GPU. Without libnvrtc the NVRTC tests FAIL, unless
//! KILN_SKIP_NVRTC_TESTS=1 is set, in which case they say loudly that they were skipped.

use std::collections::HashSet;
use std::fs;
use std::path::Path;
use std::sync::{Arc, Barrier};

use kiln_cuda::{compile_cubin, find_kernel, kernel_sources, list_devices, CacheDir, CubinCache, CubinKey, CubinOrigin, CudaError};

const ARCH: &str = "sm_90";

/// True when libnvrtc loads; otherwise fails the test unless skipping was asked for.
fn nvrtc_ready(test: &str) -> bool {
    match kiln_cuda::ensure_nvrtc() {
        Ok(()) => true,
        Err(error) if std::env::var("KILN_SKIP_NVRTC_TESTS").as_deref() == Ok("1") => {
            eprintln!("SKIPPED {test}: KILN_SKIP_NVRTC_TESTS=1 and {error}");
            false
        }
        Err(error) => panic!(
            "{test} needs libnvrtc: {error}\n(run `eval \"$(scripts/nvrtc-env.sh)\"`, or set \
             KILN_SKIP_NVRTC_TESTS=1 to skip the NVRTC tests deliberately)"
        ),
    }
}

/// Names of the function symbols of an ELF64 little-endian image (a CUBIN).
fn elf_function_symbols(image: &[u8]) -> Vec<String> {
    let u16_at = |at: usize| u16::from_le_bytes(image[at..at + 2].try_into().unwrap()) as usize;
    let u32_at = |at: usize| u32::from_le_bytes(image[at..at + 4].try_into().unwrap()) as usize;
    let u64_at = |at: usize| u64::from_le_bytes(image[at..at + 8].try_into().unwrap()) as usize;
    assert_eq!(&image[..4], b"\x7fELF", "not an ELF image");
    assert_eq!(image[4], 2, "not ELF64");
    assert_eq!(u16_at(18), 190, "e_machine is not EM_CUDA");
    let (section_table, entry_size, count) = (u64_at(40), u16_at(58), u16_at(60));
    let section = |index: usize| section_table + index * entry_size;
    let mut names = Vec::new();
    for index in 0..count {
        let header = section(index);
        const SHT_SYMTAB: usize = 2;
        if u32_at(header + 4) != SHT_SYMTAB {
            continue;
        }
        let (symbols, size, symbol_size) = (u64_at(header + 24), u64_at(header + 32), u64_at(header + 56));
        let strings = u64_at(section(u32_at(header + 40)) + 24);
        for symbol in (symbols..symbols + size).step_by(symbol_size) {
            const STT_FUNC: u8 = 2;
            if image[symbol + 4] & 0xf != STT_FUNC {
                continue;
            }
            let name_start = strings + u32_at(symbol);
            let name_len = image[name_start..].iter().position(|&b| b == 0).unwrap();
            names.push(String::from_utf8_lossy(&image[name_start..name_start + name_len]).into_owned());
        }
    }
    names
}

fn owned_defines(set: &[(&str, i64)]) -> Vec<(String, i64)> {
    set.iter().map(|&(name, value)| (name.to_string(), value)).collect()
}

#[test]
fn table_matches_the_kernel_files_on_disk() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut on_disk: Vec<String> = fs::read_dir(&dir)
        .expect("kernels/ exists")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cu"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let registered: Vec<String> = kernel_sources().iter().map(|s| s.name.to_string()).collect();
    assert_eq!(registered, on_disk, "every kernels/*.cu file is a registered source");
    for source in kernel_sources() {
        let text = fs::read_to_string(dir.join(format!("{}.cu", source.name))).expect("read source");
        assert_eq!(source.code, text, "{}.cu embedded text is stale", source.name);
        let declared = text.matches("extern \"C\" __global__").count();
        assert_eq!(source.kernels.len(), declared, "{}.cu: kernels {:?}", source.name, source.kernels);
        for kernel in source.kernels {
            assert!(text.contains(&format!(" {kernel}(")), "{}.cu does not declare {kernel}", source.name);
        }
        assert!(!source.test_defines.is_empty(), "{}: at least one test specialization", source.name);
    }
    let common = kiln_cuda::kernel_headers().iter().find(|h| h.name == "common.cuh").expect("common.cuh");
    assert!(!common.code.contains("#include <"), "common.cuh must not need toolkit headers");
}

#[test]
fn every_source_compiles_for_sm90_and_exports_every_kernel() {
    if !nvrtc_ready("every_source_compiles_for_sm90_and_exports_every_kernel") {
        return;
    }
    // Every specialization is its own NVRTC program: compile them on all cores.
    let jobs: Vec<_> = kernel_sources().iter().flat_map(|source| source.test_defines.iter().map(move |defines| (source, defines))).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).min(jobs.len());
    let failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut failures = Vec::new();
                    while let Some(&(source, defines)) = jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                        let cubin = match compile_cubin(source.name, defines, ARCH) {
                            Ok(cubin) => cubin,
                            Err(e) => {
                                failures.push(format!("{} with {defines:?}: {e}", source.name));
                                continue;
                            }
                        };
                        let symbols = elf_function_symbols(&cubin);
                        // MMA_TYPE compiles one format's pair of a mat-mat module (and the shared
                        // conversion and reduction), as the host does: only those are expected.
                        let one_format = defines.iter().any(|(name, _)| *name == "MMA_TYPE");
                        // MV_TYPE compiles one format's six mat-vec kernels (16 rows a warp is
                        // a shape of the grouped formats only).
                        let one_matvec_format = defines.iter().any(|(name, _)| *name == "MV_TYPE");
                        if one_matvec_format {
                            // The plain product `matvec_<format>` names the format; its five
                            // other products end in the same suffix.
                            let products: Vec<&String> = symbols.iter().filter(|s| s.starts_with("matvec_")).collect();
                            let plain: Vec<&&String> =
                                products.iter().filter(|s| !s.contains("swiglu_") && !s.contains("stacked_") && !s.contains("expert")).collect();
                            let one = plain.len() == 1 && products.len() == 6 && products.iter().all(|s| s.ends_with(&plain[0]["matvec".len()..]));
                            if !one {
                                failures.push(format!("{}.cu {defines:?}: not one format's six mat-vec kernels (functions: {symbols:?})", source.name));
                            }
                            continue;
                        }
                        // The grouped expert products exist only in the streaming tiles' modules,
                        // the stacked products in the pipelined and streaming ones.
                        let streaming = defines.iter().any(|&(name, value)| name == "MMA_PIPE" && value == 2);
                        let pipelined = defines.iter().any(|&(name, value)| name == "MMA_PIPE" && value > 0);
                        failures.extend(
                            source
                                .kernels
                                .iter()
                                .filter(|kernel| !one_format || kernel.starts_with("mma_"))
                                .filter(|kernel| streaming || !kernel.starts_with("matmat_groups_"))
                                .filter(|kernel| pipelined || !kernel.starts_with("matmat_stacked_"))
                                .filter(|kernel| !symbols.iter().any(|symbol| symbol == *kernel))
                                .map(|kernel| format!("{}.cu {defines:?}: `{kernel}` missing from the cubin (functions: {symbols:?})", source.name)),
                        );
                        // A quantized format's pair, plus its grouped and stacked products where
                        // the body has them (the one-format test defines are all quantized).
                        let per_format = 2 + usize::from(streaming) + usize::from(pipelined);
                        if one_format && symbols.iter().filter(|symbol| symbol.starts_with("matmat_")).count() != per_format {
                            failures.push(format!("{}.cu {defines:?}: not one format's {per_format} mat-mat kernels (functions: {symbols:?})", source.name));
                        }
                    }
                    failures
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("compile worker panicked")).collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn compile_errors_carry_the_full_nvrtc_log() {
    if !nvrtc_ready("compile_errors_carry_the_full_nvrtc_log") {
        return;
    }
    // reduce.cu refuses to build without BLOCK_SIZE (an #error), and block_sum rejects 100.
    match compile_cubin("reduce", &[], ARCH) {
        Err(CudaError::Compile { source_name, log, arch, .. }) => {
            assert_eq!(source_name, "reduce");
            assert_eq!(arch, ARCH);
            assert!(log.contains("needs -DBLOCK_SIZE"), "log lacks the #error text: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    match compile_cubin("reduce", &[("BLOCK_SIZE", 100)], ARCH) {
        Err(CudaError::Compile { defines, log, .. }) => {
            assert_eq!(defines, "BLOCK_SIZE=100");
            assert!(log.contains("multiple of 32"), "log lacks the static_assert text: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn distinct_defines_give_distinct_binaries() {
    if !nvrtc_ready("distinct_defines_give_distinct_binaries") {
        return;
    }
    let small = compile_cubin("reduce", &[("BLOCK_SIZE", 128)], ARCH).expect("BLOCK_SIZE=128");
    let large = compile_cubin("reduce", &[("BLOCK_SIZE", 1024)], ARCH).expect("BLOCK_SIZE=1024");
    assert_ne!(small, large);
    // An unused define still compiles (and is part of the key, tested below).
    compile_cubin("elementwise", &[("UNUSED", -7), ("MIN", i64::MIN)], ARCH).expect("unused defines");
}

#[test]
fn cache_keys_separate_everything_that_shapes_the_binary() {
    let key = |source: &str, defines: &[(&str, i64)], arch: &str| CubinKey::new(source, defines, arch).expect("valid key");
    let nvrtc = (13, 0);
    let base = key("reduce", &[("BLOCK_SIZE", 128), ("UNROLL", 4)], ARCH);
    let reordered = key("reduce", &[("UNROLL", 4), ("BLOCK_SIZE", 128)], ARCH);
    assert_eq!(base, reordered, "define order is irrelevant");
    assert_eq!(base.file_name(nvrtc), reordered.file_name(nvrtc));
    assert_eq!(base.defines(), owned_defines(&[("BLOCK_SIZE", 128), ("UNROLL", 4)]).as_slice());

    let variants = [
        key("reduce", &[("BLOCK_SIZE", 256), ("UNROLL", 4)], ARCH),
        key("reduce", &[("BLOCK_SIZE", 128)], ARCH),
        key("reduce", &[("BLOCK_SIZE", 128), ("UNROLL", 4), ("X", 0)], ARCH),
        key("reduce", &[("BLOCK_SIZE", 128), ("UNROLLX", 4)], ARCH),
        key("reduce", &[("BLOCK_SIZE", 128), ("UNROLL", 4)], "sm_90a"),
        key("reduce", &[("BLOCK_SIZE", 128), ("UNROLL", 4)], "sm_80"),
        key("elementwise", &[("BLOCK_SIZE", 128), ("UNROLL", 4)], ARCH),
    ];
    let mut names = HashSet::from([base.file_name(nvrtc)]);
    for variant in &variants {
        assert_ne!(&base, variant);
        assert!(names.insert(variant.file_name(nvrtc)), "file name collision for {variant:?}");
    }
    assert_ne!(base.file_name(nvrtc), base.file_name((13, 1)), "the NVRTC version is in the file name");
    assert!(base.file_name(nvrtc).starts_with("reduce-") && base.file_name(nvrtc).ends_with(".cubin"));

    assert!(matches!(CubinKey::new("reduce", &[("A", 1), ("A", 2)], ARCH), Err(CudaError::InvalidDefine { reason: "defined more than once", .. })));
    assert!(matches!(CubinKey::new("reduce", &[("A B", 1)], ARCH), Err(CudaError::InvalidDefine { .. })));
    assert!(matches!(CubinKey::new("reduce", &[], "compute_90"), Err(CudaError::InvalidArch { .. })));
}

#[test]
fn unknown_sources_and_kernels_are_typed_errors_listing_what_exists() {
    match find_kernel("no_such_file", "add_f32") {
        Err(CudaError::UnknownSource { name, available }) => {
            assert_eq!(name, "no_such_file");
            assert!(available.contains(&"elementwise"), "{available:?}");
        }
        other => panic!("expected UnknownSource, got {other:?}"),
    }
    match find_kernel("elementwise", "no_such_kernel") {
        Err(CudaError::KernelNotFound { source_name, kernel, available }) => {
            assert_eq!((source_name.as_str(), kernel.as_str()), ("elementwise", "no_such_kernel"));
            assert!(available.contains(&"add_f32"), "{available:?}");
        }
        other => panic!("expected KernelNotFound, got {other:?}"),
    }
    // A kernel of another file is not found in this one.
    assert!(matches!(find_kernel("elementwise", "f16_to_f32"), Err(CudaError::KernelNotFound { .. })));
    assert_eq!(find_kernel("convert", "f16_to_f32").expect("exists").name, "convert");
    assert!(matches!(compile_cubin("no_such_file", &[], ARCH), Err(CudaError::UnknownSource { .. })));
}

fn cache_in(dir: &Path) -> CubinCache {
    let cache = CubinCache::new(&CacheDir::At(dir.to_path_buf()));
    assert_eq!(cache.dir(), Some(dir), "the temp dir is writable");
    cache
}

#[test]
fn disk_cache_hits_return_the_compiled_bytes() {
    if !nvrtc_ready("disk_cache_hits_return_the_compiled_bytes") {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let key = CubinKey::new("elementwise", &[], ARCH).expect("key");
    let first = cache_in(dir.path()).get_or_compile(&key).expect("compile");
    assert_eq!(first.origin, CubinOrigin::Compiled);
    let path = cache_in(dir.path()).entry_path(&key).expect("path").expect("disk cache on");
    assert!(path.exists(), "entry written to {}", path.display());
    // A fresh cache object stands for another process.
    let second = cache_in(dir.path()).get_or_compile(&key).expect("hit");
    assert_eq!(second.origin, CubinOrigin::Disk);
    assert_eq!(second.bytes, first.bytes);
    let other = CubinKey::new("elementwise", &[("X", 1)], ARCH).expect("key");
    assert_eq!(cache_in(dir.path()).get_or_compile(&other).expect("compile").origin, CubinOrigin::Compiled);
}

#[test]
fn corrupt_disk_entries_are_detected_deleted_and_recompiled() {
    if !nvrtc_ready("corrupt_disk_entries_are_detected_deleted_and_recompiled") {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = cache_in(dir.path());
    let key = CubinKey::new("convert", &[], ARCH).expect("key");
    let good = cache.get_or_compile(&key).expect("compile").bytes;
    let path = cache.entry_path(&key).expect("path").expect("disk cache on");
    let entry = fs::read(&path).expect("entry");
    let corruptions: Vec<(&str, Vec<u8>)> = vec![
        ("payload byte flipped", {
            let mut e = entry.clone();
            let middle = e.len() / 2;
            e[middle] ^= 0x01;
            e
        }),
        ("magic byte flipped", {
            let mut e = entry.clone();
            e[0] ^= 0x20;
            e
        }),
        ("truncated payload", entry[..entry.len() - 100].to_vec()),
        ("truncated header", entry[..20].to_vec()),
        ("empty file", Vec::new()),
    ];
    for (what, corrupt) in corruptions {
        fs::write(&path, &corrupt).expect("write corrupt entry");
        let again = cache.get_or_compile(&key).expect("recompile");
        assert_eq!(again.origin, CubinOrigin::Compiled, "{what}: corruption not detected");
        assert_eq!(again.bytes, good, "{what}: recompiled bytes differ");
        assert_eq!(fs::read(&path).expect("rewritten"), entry, "{what}: entry not rewritten");
        assert_eq!(cache.get_or_compile(&key).expect("hit").origin, CubinOrigin::Disk, "{what}");
    }
}

#[test]
fn concurrent_writers_leave_one_valid_entry() {
    if !nvrtc_ready("concurrent_writers_leave_one_valid_entry") {
        return;
    }
    const WRITERS: usize = 6;
    let dir = tempfile::tempdir().expect("temp dir");
    let key = CubinKey::new("reduce", &[("BLOCK_SIZE", 256)], ARCH).expect("key");
    let start = Arc::new(Barrier::new(WRITERS));
    let results: Vec<Vec<u8>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..WRITERS)
            .map(|_| {
                let (start, key, dir) = (start.clone(), &key, dir.path());
                scope.spawn(move || {
                    let cache = CubinCache::new(&CacheDir::At(dir.to_path_buf()));
                    start.wait();
                    cache.get_or_compile(key).expect("compile or hit").bytes
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().expect("writer thread")).collect()
    });
    assert!(results.windows(2).all(|pair| pair[0] == pair[1]), "writers disagree on the bytes");
    let names: Vec<String> = fs::read_dir(dir.path()).expect("dir").map(|e| e.expect("entry").file_name().to_string_lossy().into()).collect();
    assert_eq!(names, vec![key.file_name(kiln_cuda::nvrtc_version().expect("version"))], "stray files: {names:?}");
    let hit = cache_in(dir.path()).get_or_compile(&key).expect("hit");
    assert_eq!(hit.origin, CubinOrigin::Disk);
    assert_eq!(hit.bytes, results[0]);
}

#[test]
fn listing_devices_reports_errors_instead_of_panicking() {
    // On a machine without a driver or GPU this must be an error naming the problem.
    match list_devices() {
        Ok(devices) => {
            for device in &devices {
                assert!(!device.name.is_empty() && device.total_memory_bytes > 0, "{device:?}");
            }
        }
        Err(error) => {
            assert!(matches!(error, CudaError::DriverUnavailable(_) | CudaError::Driver { .. }), "unexpected error kind: {error:?}");
            assert!(!error.to_string().is_empty());
            eprintln!("no CUDA device here: {error}");
        }
    }
}
