//! GPU tests of the registry and device layer. They need an NVIDIA GPU, libcuda and libnvrtc:
//! run them on the device with scripts/gpu-tests.sh (which passes --include-ignored).

mod common;
use common::rng;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::{bf16, f16};
use kiln_cuda::{CacheDir, CubinCache, CubinKey, CubinOrigin, CudaDevice, CudaError, KernelRegistry, RegistryConfig};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

fn open_device() -> CudaDevice {
    CudaDevice::new(0, RegistryConfig { cache_dir: CacheDir::MemoryOnly, ..Default::default() }).unwrap_or_else(|e| panic!("opening GPU 0 failed: {e}"))
}

fn random_f32(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-4.0f32..4.0)).collect()
}

/// A grid deliberately smaller than the data, so the kernels' grid-stride loops are exercised.
fn strided_launch(len: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: ((len as u32).div_ceil(256).min(97), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

fn function(device: &CudaDevice, source: &str, kernel: &str, defines: &[(&str, i64)]) -> CudaFunction {
    device.registry().function(source, kernel, defines).unwrap_or_else(|e| panic!("{source}/{kernel}: {e}"))
}

/// Runs a one-input, one-output elementwise kernel `(out, input, [extra], n)` on a poisoned output.
fn run_unary<I, O>(device: &CudaDevice, source: &str, kernel: &str, input: &[I], extra: Option<f32>) -> Vec<O>
where
    I: cudarc::driver::DeviceRepr,
    O: cudarc::driver::DeviceRepr + bytemuck::Pod,
{
    let func = function(device, source, kernel, &[]);
    let input = device.upload(input, "test input").expect("upload");
    let mut output: CudaSlice<O> = device.alloc_poisoned(input.len(), "test output").expect("alloc");
    let n = input.len() as u64;
    let mut launch = device.stream().launch_builder(&func);
    launch.arg(&mut output).arg(&input);
    if let Some(extra) = extra.as_ref() {
        launch.arg(extra);
    }
    launch.arg(&n);
    unsafe { launch.launch(strided_launch(input.len())) }.expect("launch");
    device.download(&output).expect("download")
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn elementwise_kernels_match_the_cpu_exactly() {
    let device = open_device();
    let mut rng = rng("elementwise");
    let len = 1_000_003;
    let (a, b) = (random_f32(&mut rng, len), random_f32(&mut rng, len));
    let func = function(&device, "elementwise", "add_f32", &[]);
    let (a_gpu, b_gpu) = (device.upload(&a, "a").expect("a"), device.upload(&b, "b").expect("b"));
    let mut sum: CudaSlice<f32> = device.alloc_poisoned(len, "sum").expect("alloc");
    let n = len as u64;
    unsafe { device.stream().launch_builder(&func).arg(&mut sum).arg(&a_gpu).arg(&b_gpu).arg(&n).launch(strided_launch(len)) }.expect("launch add_f32");
    let sum = device.download(&sum).expect("download");
    // A single IEEE add or multiply is correctly rounded on both sides: results are bit-identical.
    for i in 0..len {
        assert_eq!(sum[i].to_bits(), (a[i] + b[i]).to_bits(), "add_f32 at {i}: {} + {}", a[i], b[i]);
    }
    let factor = 0.731_f32;
    let scaled: Vec<f32> = run_unary(&device, "elementwise", "scale_f32", &a, Some(factor));
    for i in 0..len {
        assert_eq!(scaled[i].to_bits(), (a[i] * factor).to_bits(), "scale_f32 at {i}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn fill_kernels_overwrite_every_poisoned_element() {
    let device = open_device();
    let len = 300_001;
    let n = len as u64;
    let mut words: CudaSlice<u32> = device.alloc_poisoned(len, "words").expect("alloc");
    let mut halves: CudaSlice<u16> = device.alloc_poisoned(len, "halves").expect("alloc");
    assert!(device.download(&words).expect("download").iter().all(|&w| w == u32::MAX), "poison is 0xFF bytes");
    let (word, half) = (0x7fc0_dead_u32, 0x7e01_u16);
    let fill32 = function(&device, "elementwise", "fill_u32", &[]);
    let fill16 = function(&device, "elementwise", "fill_u16", &[]);
    unsafe { device.stream().launch_builder(&fill32).arg(&mut words).arg(&word).arg(&n).launch(strided_launch(len)) }.expect("fill_u32");
    unsafe { device.stream().launch_builder(&fill16).arg(&mut halves).arg(&half).arg(&n).launch(strided_launch(len)) }.expect("fill_u16");
    assert!(device.download(&words).expect("download").iter().all(|&w| w == word));
    assert!(device.download(&halves).expect("download").iter().all(|&h| h == half));
    let zeros: CudaSlice<f32> = device.alloc_zeros(len, "zeros").expect("alloc");
    assert!(device.download(&zeros).expect("download").iter().all(|&z| z.to_bits() == 0));
}

fn same_float(gpu: f32, cpu: f32) -> bool {
    gpu.to_bits() == cpu.to_bits() || (gpu.is_nan() && cpu.is_nan())
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn half_precision_conversions_match_the_half_crate() {
    let device = open_device();
    // Widening is exact, so every one of the 65536 patterns must match bit for bit (NaN payloads aside).
    let patterns: Vec<u16> = (0..=u16::MAX).collect();
    let from_f16: Vec<f32> = run_unary(&device, "convert", "f16_to_f32", &patterns, None);
    let from_bf16: Vec<f32> = run_unary(&device, "convert", "bf16_to_f32", &patterns, None);
    for (i, &bits) in patterns.iter().enumerate() {
        assert!(same_float(from_f16[i], f16::from_bits(bits).to_f32()), "f16 {bits:#06x} -> {}", from_f16[i]);
        assert!(same_float(from_bf16[i], bf16::from_bits(bits).to_f32()), "bf16 {bits:#06x} -> {}", from_bf16[i]);
    }
    // Narrowing rounds to nearest even on both sides: random values across the whole range,
    // f16 subnormals and overflow, ties, and the special values.
    let mut rng = rng("conversions");
    let mut values: Vec<f32> = (0..200_000).map(|_| f32::from_bits(rng.gen())).collect();
    values.extend((0..100_000).map(|_| rng.gen_range(-70_000.0f32..70_000.0)));
    values.extend((0..100_000).map(|_| rng.gen_range(-1e-4f32..1e-4)));
    values.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65504.0, 65520.0, 1.0 + f32::EPSILON * 1024.0]);
    let to_f16: Vec<u16> = run_unary(&device, "convert", "f32_to_f16", &values, None);
    let to_bf16: Vec<u16> = run_unary(&device, "convert", "f32_to_bf16", &values, None);
    for (i, &value) in values.iter().enumerate() {
        let (gpu, cpu) = (f16::from_bits(to_f16[i]), f16::from_f32(value));
        assert!(gpu.to_bits() == cpu.to_bits() || (gpu.is_nan() && cpu.is_nan()), "f32->f16 {value:e}: {gpu} vs {cpu}");
        let (gpu, cpu) = (bf16::from_bits(to_bf16[i]), bf16::from_f32(value));
        assert!(gpu.to_bits() == cpu.to_bits() || (gpu.is_nan() && cpu.is_nan()), "f32->bf16 {value:e}: {gpu} vs {cpu}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn row_sum_matches_an_f64_reference_for_each_block_size() {
    let device = open_device();
    let mut rng = rng("row_sum");
    let (rows, cols) = (37usize, 5_000usize);
    let x = random_f32(&mut rng, rows * cols);
    let x_gpu = device.upload(&x, "matrix").expect("upload");
    for block in [128i64, 256, 1024] {
        let func = function(&device, "reduce", "row_sum_f32", &[("BLOCK_SIZE", block)]);
        let mut out: CudaSlice<f32> = device.alloc_poisoned(rows, "row sums").expect("alloc");
        let cols_arg = cols as u32;
        let config = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (block as u32, 1, 1), shared_mem_bytes: 0 };
        unsafe { device.stream().launch_builder(&func).arg(&mut out).arg(&x_gpu).arg(&cols_arg).launch(config) }.expect("launch row_sum_f32");
        let out = device.download(&out).expect("download");
        for row in 0..rows {
            let values = &x[row * cols..(row + 1) * cols];
            let exact: f64 = values.iter().map(|&v| v as f64).sum();
            let magnitude: f64 = values.iter().map(|&v| (v as f64).abs()).sum();
            // Each thread adds cols/BLOCK values serially, then a tree of log2(BLOCK) levels:
            // the rounding error is at most (cols/BLOCK + log2(BLOCK) + 1) ulps of sum |x|.
            let depth = (cols as f64 / block as f64).ceil() + (block as f64).log2() + 1.0;
            let tolerance = depth * f32::EPSILON as f64 * magnitude;
            let error = (out[row] as f64 - exact).abs();
            assert!(error <= tolerance, "BLOCK_SIZE={block} row {row}: {} vs {exact} (error {error:e} > {tolerance:e})", out[row]);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn modules_are_compiled_once_per_key_and_shared() {
    let device = open_device();
    let registry = device.registry();
    assert_eq!(registry.arch(), device.info().arch());
    let a = registry.module("reduce", &[("BLOCK_SIZE", 128), ("UNROLL", 2)]).expect("module");
    let b = registry.module("reduce", &[("UNROLL", 2), ("BLOCK_SIZE", 128)]).expect("module");
    let c = registry.module("reduce", &[("BLOCK_SIZE", 256), ("UNROLL", 2)]).expect("module");
    assert!(Arc::ptr_eq(&a, &b), "same defines in another order share the module");
    assert!(!Arc::ptr_eq(&a, &c), "other constants give another module");
    // Many threads racing on one new key all end up with the same module.
    let modules: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8).map(|_| scope.spawn(|| registry.module("elementwise", &[("RACE", 1)]).expect("module"))).collect();
        handles.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert!(modules.windows(2).all(|pair| Arc::ptr_eq(&pair[0], &pair[1])));
    assert!(Arc::ptr_eq(&modules[0], &registry.module("elementwise", &[("RACE", 1)]).expect("module")));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn a_second_registry_loads_modules_from_the_disk_cache() {
    let device = open_device();
    let dir = tempfile::tempdir().expect("temp dir");
    let config = || RegistryConfig { cache_dir: CacheDir::At(dir.path().to_path_buf()), ..Default::default() };
    let first = KernelRegistry::new(device.context().clone(), config()).expect("registry");
    first.function("convert", "f16_to_f32", &[]).expect("compile and load");
    let key = CubinKey::new("convert", &[], first.arch()).expect("key");
    let entry = first.cubin_cache().entry_path(&key).expect("path").expect("disk cache on");
    assert!(entry.exists(), "{} written", entry.display());
    let second = KernelRegistry::new(device.context().clone(), config()).expect("registry");
    assert_eq!(second.cubin_cache().get_or_compile(&key).expect("hit").origin, CubinOrigin::Disk);
    second.function("convert", "bf16_to_f32", &[]).expect("load from disk");
    let memory_only = CubinCache::new(&CacheDir::MemoryOnly);
    assert_eq!(memory_only.entry_path(&key).expect("path"), None);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn registry_errors_are_typed() {
    let device = open_device();
    let registry = device.registry();
    assert!(matches!(registry.function("no_such_file", "add_f32", &[]), Err(CudaError::UnknownSource { .. })));
    assert!(matches!(registry.function("elementwise", "nope", &[]), Err(CudaError::KernelNotFound { .. })));
    match registry.module("reduce", &[]) {
        Err(CudaError::Compile { log, .. }) => assert!(log.contains("BLOCK_SIZE"), "{log}"),
        other => panic!("expected a compile error, got {other:?}"),
    }
    // Code for another architecture does not load on this device.
    let foreign =
        KernelRegistry::new(device.context().clone(), RegistryConfig { cache_dir: CacheDir::MemoryOnly, arch: Some("sm_75".into()), ..Default::default() })
            .expect("registry");
    assert!(matches!(foreign.module("elementwise", &[]), Err(CudaError::Load { .. })));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn absurd_allocations_are_out_of_memory_errors() {
    let device = open_device();
    let (_, total) = device.memory_info().expect("memory info");
    let elements = total; // 4x the card's memory, in f32s
    match unsafe { device.alloc_uninit::<f32>(elements, "absurd buffer") } {
        Err(CudaError::OutOfMemory { requested_bytes, free_bytes, what }) => {
            assert_eq!(requested_bytes, elements * 4);
            assert!(free_bytes > 0 && free_bytes <= total, "free {free_bytes} of {total}");
            assert_eq!(what, "absurd buffer");
        }
        other => panic!("expected OutOfMemory, got {:?}", other.map(|s| s.len())),
    }
    // A byte count that overflows usize must not wrap into a small allocation.
    assert!(matches!(
        unsafe { device.alloc_uninit::<f32>(usize::MAX / 2, "overflowing buffer") },
        Err(CudaError::OutOfMemory { requested_bytes: usize::MAX, .. })
    ));
    // The failure is not sticky.
    let small: CudaSlice<f32> = device.alloc_zeros(1024, "small buffer").expect("allocation after OOM");
    assert_eq!(device.download(&small).expect("download").len(), 1024);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn pinned_uploads_round_trip_across_chunk_boundaries() {
    let device = open_device();
    let mut rng = rng("pinned_upload");
    let chunk = kiln_cuda::STAGING_CHUNK_BYTES;
    for len in [0, 1, 4097, chunk, 2 * chunk + 12_345] {
        let bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        let uploaded = device.upload_via_pinned(&bytes, "weights").unwrap_or_else(|e| panic!("{len} bytes: {e}"));
        assert_eq!(uploaded.len(), len);
        assert!(device.download(&uploaded).expect("download") == bytes, "{len} bytes differ after the round trip");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-tests.sh on the device"]
fn devices_are_listed_with_plausible_properties() {
    let devices = kiln_cuda::list_devices().expect("list devices");
    assert!(!devices.is_empty());
    for info in &devices {
        eprintln!("{info}");
        assert!(info.multiprocessor_count > 0 && info.l2_cache_bytes > 0, "{info:?}");
        assert!(info.free_memory_bytes <= info.total_memory_bytes && info.total_memory_bytes > 0);
        assert!(info.max_shared_memory_per_block_optin >= 48 << 10);
        assert!(info.driver_version.0 >= 12, "{info:?}");
    }
}
