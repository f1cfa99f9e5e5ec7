//! Host-side checks of the weight products: kernel names, guards, layouts and launch choices.
use super::kernels::{kernel_id, kernel_type_id};
use super::matmat::{choose_tile, MMA_TILES};
use super::*;

#[test]
fn weights_and_activation_buffers_can_be_shared_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<GpuWeight>();
    shareable::<QuantizedActivations>();
}

/// The kernels' argument structs keep the C layout of `Planes` and `FloatRows`.
#[test]
fn kernel_argument_structs_have_the_device_layout() {
    assert_eq!(size_of::<PlanesArg>(), 32);
    assert_eq!(std::mem::offset_of!(PlanesArg, tiles), 24);
    assert_eq!(size_of::<FloatArg>(), 16);
    assert_eq!(std::mem::offset_of!(FloatArg, stride), 8);
}

/// Each format's mat-mat pair in matmat_mma.cu sits under the guard of its own type id, so
/// compiling with `MMA_TYPE` keeps exactly the kernels `kernel_id` asks for.
#[test]
fn mat_mat_pairs_are_guarded_by_their_type() {
    let source = include_str!("../../kernels/matmat_mma.cu");
    let (mut guard, mut nested) = (None, 0);
    let mut seen = 0;
    for line in source.lines() {
        if let Some(id) = line.strip_prefix("#if MMA_WANTS(").and_then(|r| r.strip_suffix(')')) {
            guard = Some(id.parse::<i64>().expect("numeric type id"));
        } else if line.starts_with("#if") && guard.is_some() {
            nested += 1;
        } else if line == "#endif" {
            if nested > 0 {
                nested -= 1;
            } else {
                guard = None;
            }
        } else if let Some(rest) = line.split(") matmat_").nth(1) {
            let name = rest.split('(').next().unwrap();
            let suffix = ["swiglu_", "groups_", "stacked_"].iter().find_map(|p| name.strip_prefix(p)).unwrap_or(name);
            assert_eq!(guard, Some(kernel_type_id(suffix)), "matmat_{name} is not under its type's guard");
            seen += 1;
        }
    }
    // Every format's pair, and the grouped expert product and stacked product of each quantized one.
    assert_eq!(seen, 54 + 2 * 24);
}

/// Every kernel the host can ask for is declared in the source it is looked up in.
#[test]
fn every_format_finds_its_kernels() {
    let null_planes = PlanesArg { codes: 0, extra: 0, scales: 0, tiles: 0, _pad: 0 };
    let null_rows = FloatArg { data: 0, stride: 0, _pad: 0 };
    let mut storages: Vec<Storage> =
        [FloatKind::F32, FloatKind::F16, FloatKind::BF16].into_iter().map(|kind| Storage::Float { kind, rows: null_rows }).collect();
    for &ty in kiln_quant::ALL_TYPES {
        if let Some(layout) = quant_layout(ty) {
            storages.push(Storage::Quant { layout, planes: null_planes });
        }
    }
    assert_eq!(storages.len(), 28, "every format of the module docs");
    for storage in &storages {
        let mut kernels = vec![Kernel::Embed];
        for (tile, shape) in MMA_TILES.iter().enumerate() {
            kernels.extend([Kernel::Matmat { tile, swiglu: false }, Kernel::Matmat { tile, swiglu: true }]);
            kernels.extend([Kernel::MatmatHalf { tile }, Kernel::MatmatReduce { tile }]);
            if shape.is_streaming() && matches!(storage, Storage::Quant { .. }) {
                kernels.push(Kernel::MatmatGroups { tile });
            }
            if shape.pipelined() && matches!(storage, Storage::Quant { .. }) {
                kernels.extend([Kernel::MatmatStacked { tile }, Kernel::MatmatReduceStacked { tile }]);
            }
        }
        for ntok in 1..=MAX_MATVEC_TOKENS {
            for shape in 0..MATVEC_SHAPES.len() {
                // Only quantized weights stack (stacked.rs); float ones take f32 activations.
                let kinds: &[MatvecKind] = if matches!(storage, Storage::Quant { .. }) {
                    &[MatvecKind::Plain, MatvecKind::SwiGlu, MatvecKind::Stacked, MatvecKind::Experts, MatvecKind::ExpertGroups, MatvecKind::ExpertsGated]
                } else {
                    &[MatvecKind::Plain, MatvecKind::SwiGlu, MatvecKind::Experts]
                };
                kernels.extend(kinds.iter().map(|&kind| Kernel::Matvec { ntok, kind, shape }));
            }
        }
        for kernel in kernels {
            let (source, name, _) = kernel_id(storage, kernel);
            crate::find_kernel(source, &name).unwrap_or_else(|e| panic!("{storage:?}: {e}"));
        }
    }
}

/// The launch geometry here and the kernels' #defines agree.
#[test]
fn host_constants_match_the_kernel_defines() {
    let define = crate::sources::define_value;
    let (quant, activations, matvec, float, matmat, norm) = (
        include_str!("../../kernels/quant.cuh"),
        include_str!("../../kernels/activation_q8.cuh"),
        include_str!("../../kernels/matvec.cuh"),
        include_str!("../../kernels/matvec_float.cu"),
        include_str!("../../kernels/matmat_mma.cu"),
        include_str!("../../kernels/norm.cuh"),
    );
    assert_eq!(define(norm, "NORM_BLOCK"), NORM_THREADS);
    assert_eq!(define(norm, "WARP_NORM_MAX_DIM") as usize, crate::backend::WARP_NORM_MAX_DIM);
    assert_eq!(define(quant, "TILE_VALUES") as usize, TILE_VALUES);
    assert_eq!(define(activations, "CHUNK_VALUES") as usize, CHUNK_VALUES);
    assert_eq!(define(matvec, "MV_WARPS"), MV_WARPS);
    assert_eq!(define(float, "FV_ROW_WARPS"), FV_ROW_WARPS);
    assert_eq!(define(float, "FV_ROW_ROWS"), FV_ROW_ROWS);
    assert_eq!(define(matmat, "MMA_THREADS"), MMA_THREADS);
}

/// Every mat-vec launch shape's kind of block (rows a warp, warps a row, warps a block) is
/// one the compile test builds for both quantized sources.
#[test]
fn every_matvec_shape_is_a_tested_specialization() {
    for name in ["matvec_legacy", "matvec_kquant"] {
        let source = crate::find_source(name).expect("matvec source");
        let value = |set: &[(&str, i64)], key: &str, default: i64| set.iter().find(|(k, _)| *k == key).map_or(default, |&(_, v)| v);
        for s in MATVEC_SHAPES {
            let built = source.test_defines.iter().any(|set| {
                value(set, "ROWS_PER_WARP", 0) == i64::from(s.rows_per_warp)
                    && value(set, "MV_SPLIT", 1) == i64::from(s.split)
                    && value(set, "MV_WARPS", i64::from(MV_WARPS)) == i64::from(s.warps)
            });
            assert!(built, "{name}: {s:?} has no kiln-test-defines line");
        }
    }
}

/// Every mat-mat tile the host launches is one the compile test builds.
#[test]
fn every_matmat_tile_is_a_tested_specialization() {
    let source = crate::find_source("matmat_mma").expect("matmat_mma.cu");
    for tile in MMA_TILES {
        let defines = tile.defines();
        assert!(source.test_defines.iter().any(|set| set.iter().copied().eq(defines.iter().copied())), "{tile:?} has no kiln-test-defines line");
    }
}

#[test]
fn matmat_tiles_fill_the_gpu_without_wasting_tokens() {
    let sms = 132;
    // pp512 on an 8B model: the FFN pair and q/o take big tiles, k/v (1024 rows) small ones.
    assert_eq!(choose_tile(14336, 512, true, sms), 0);
    // 4096 rows: 128x128's 128 blocks (one per multiprocessor) beat 128x64 (measured).
    assert_eq!(choose_tile(4096, 512, false, sms), 0);
    assert_eq!(choose_tile(1024, 512, false, sms), 3);
    // Decode batches: 9..32 tokens never take a 64-token tile, 64 never a 128-token one.
    for n in 9..=32 {
        assert_eq!(MMA_TILES[choose_tile(14336, n, true, sms)].tokens, 32, "n = {n}");
    }
    assert!(MMA_TILES[choose_tile(14336, 64, false, sms)].tokens <= 64);
    // A tiny product still gets a tile.
    assert_eq!(choose_tile(1, 9, false, sms), 3);
    // Measured at n = 64: 64x64 for 14336 rows, 32x32 for 4096.
    assert_eq!(choose_tile(14336, 64, false, sms), 2);
    assert_eq!(choose_tile(4096, 64, false, sms), 3);
}
