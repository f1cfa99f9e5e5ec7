//! `kiln dev random-model` on the mixture-of-experts and hybrid shapes: full-size plans
//! against the published models, and small variants of each that kiln loads and runs.

use std::process::Command;
use std::sync::Arc;

use kiln_core::CpuBackend;
use kiln_gguf::GgufFile;
use kiln_models::{Logits, Model, ModelOptions};
use kiln_quant::file::{FileType, QuantizeOptions};
use kiln_quant::synthetic::{find_shape, ModelShape, Moe, RandomModel, ShapeKind};

fn dry_run(shape: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln")).args(["dev", "random-model", "unused.gguf", "--shape", shape, "--dry-run"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn number_after(out: &str, label: &str) -> f64 {
    let rest = &out[out.find(label).unwrap_or_else(|| panic!("no {label}")) + label.len()..];
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

/// The type the plan gives `tensor`.
fn planned_type<'a>(out: &'a str, tensor: &str) -> &'a str {
    let line = out.lines().find(|l| l.split_whitespace().next() == Some(tensor)).unwrap_or_else(|| panic!("no {tensor}"));
    line.split_whitespace().nth(1).unwrap()
}

/// Published totals (parameters) and the sizes of the released Q4_K_M / MXFP4 files.
#[test]
fn full_size_plans_match_the_published_models() {
    // (shape, published parameters, GiB of tensor data the mix should give, tolerance)
    let cases = [
        ("qwen3-30b-a3b", 30.5e9, 17.3, 0.03),
        ("gemma4-26b-a4b", 25.2e9, 15.6, 0.05),
        ("qwen3.5-35b-a3b", 35.0e9, 19.7, 0.05),
        ("gpt-oss-20b", 20.9e9, 11.3, 0.05),
        // Qwen2.5-7B-Instruct's Q4_K_M release: 4.68 GB.
        ("qwen2.5-7b", 7.62e9, 4.36, 0.02),
    ];
    for (shape, params, gib, tol) in cases {
        let out = dry_run(shape);
        let n = number_after(&out, "parameters:");
        assert!((n / params - 1.0).abs() < 0.015, "{shape}: {n} parameters, published {params}");
        let bytes = number_after(&out, "tensor data:") / (1u64 << 30) as f64;
        assert!((bytes / gib - 1.0).abs() < tol, "{shape}: {bytes:.2} GiB");
    }
    let q3 = dry_run("qwen3-30b-a3b");
    assert_eq!(planned_type(&q3, "blk.0.ffn_down_exps.weight"), "Q6_K", "use-more-bits layer");
    assert_eq!(planned_type(&q3, "blk.10.ffn_down_exps.weight"), "Q4_K");
    assert_eq!(planned_type(&q3, "blk.10.ffn_gate_exps.weight"), "Q4_K");
    assert_eq!(planned_type(&q3, "blk.10.ffn_gate_inp.weight"), "F32");
    assert_eq!(planned_type(&q3, "output.weight"), "Q6_K");
    let q25 = dry_run("qwen2.5-7b");
    assert_eq!(planned_type(&q25, "blk.0.attn_q.bias"), "F32", "qwen2's projection biases");
    assert_eq!(planned_type(&q25, "blk.0.attn_v.weight"), "Q6_K");
    let oss = dry_run("gpt-oss-20b");
    assert_eq!(planned_type(&oss, "blk.3.ffn_up_exps.weight"), "MXFP4");
    assert_eq!(planned_type(&oss, "blk.3.attn_q.weight"), "Q8_0");
    assert_eq!(planned_type(&oss, "blk.3.attn_sinks.weight"), "F32");
    assert_eq!(planned_type(&oss, "blk.3.ffn_down_exps.bias"), "F32");
    let g4 = dry_run("gemma4-26b-a4b");
    // 704-wide expert rows are not a multiple of 256: Q4_K falls back to Q5_0 (Q6_K to Q8_0).
    assert_eq!(planned_type(&g4, "blk.1.ffn_down_exps.weight"), "Q8_0");
    assert_eq!(planned_type(&g4, "blk.10.ffn_down_exps.weight"), "Q5_0");
    assert!(g4.contains("blk.5.attn_q.weight") && !g4.contains("blk.5.attn_v.weight"), "full layers have K = V");
    let q35 = dry_run("qwen3.5-35b-a3b");
    assert_eq!(planned_type(&q35, "blk.0.ssm_conv1d.weight"), "F32");
    assert!(q35.contains("blk.0.ssm_out.weight") && q35.contains("blk.3.attn_q_norm.weight") && !q35.contains("blk.3.ssm_out.weight"));
}

fn small_moe(m: Moe) -> Moe {
    Moe { n_expert: 8, n_used: 2, n_ff_exp: 64, n_ff_shexp: if m.n_ff_shexp > 0 { 64 } else { 0 } }
}

/// `shape` scaled down (vocabulary, widths, experts), its layer pattern kept.
fn small(shape: &str) -> ModelShape {
    let s = find_shape(shape).unwrap();
    let kind = match s.kind {
        ShapeKind::Moe(m) => ShapeKind::Moe(small_moe(m)),
        ShapeKind::Gemma4(g) => ShapeKind::Gemma4(kiln_quant::synthetic::Gemma4 { moe: small_moe(g.moe), window: 8, head_dim_full: 128, n_rot_full: 32, ..g }),
        ShapeKind::Qwen35(q) => ShapeKind::Qwen35(kiln_quant::synthetic::Qwen35 {
            moe: small_moe(q.moe),
            k_heads: 2,
            v_heads: 4,
            d_state: 64,
            n_rot: 16,
            sections: [3, 3, 2, 0],
            ..q
        }),
        ShapeKind::GptOss(g) => ShapeKind::GptOss(kiln_quant::synthetic::GptOss { moe: small_moe(g.moe), window: 8, ..g }),
        ShapeKind::Dense => panic!("{shape} is dense"),
    };
    let n_ff = if s.n_ff == 0 { 0 } else { 256 };
    let n_layer = match s.kind {
        ShapeKind::Gemma4(g) => g.period,
        ShapeKind::Qwen35(q) => q.interval,
        _ => 2,
    };
    ModelShape { n_embd: 256, n_layer, n_head: 4, n_head_kv: 2, head_dim: 64, n_ff, n_vocab: 512, n_special: 8, n_ctx: 256, kind, ..s }
}

#[test]
fn small_variants_load_and_run_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["qwen3-30b-a3b", "gemma4-26b-a4b", "qwen3.5-35b-a3b", "gpt-oss-20b"] {
        let shape = small(name);
        let model = RandomModel::new(shape, 3);
        let ftype = shape.default_file_type();
        assert_eq!(ftype, if name == "gpt-oss-20b" { FileType::MXFP4_MOE } else { FileType::Q4_K_M });
        let options = QuantizeOptions::new(ftype);
        let path = dir.path().join(format!("{name}.gguf"));
        model.write(&path, &options, &()).unwrap();
        let file = Arc::new(GgufFile::open(&path).unwrap());
        for plan in model.plan(&options).unwrap() {
            let t = file.tensor(&plan.name).unwrap_or_else(|| panic!("{name}: {} missing", plan.name));
            assert_eq!((t.ty, &t.dims), (plan.dst_type, &plan.dims), "{name}: {}", plan.name);
        }
        let opts = ModelOptions { n_ctx: Some(64), n_batch: 16, all_logits: true, ..Default::default() };
        let mut m = Model::load(Arc::new(CpuBackend::new()), file, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(m.config.arch.name(), shape.arch);
        let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 500).collect();
        let logits = m.forward(&tokens, Logits::All).unwrap();
        assert_eq!(logits.len(), tokens.len() * 512);
        assert!(logits.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
        let spread = logits.iter().fold(0f32, |a, &v| a.max(v.abs()));
        assert!(spread > 1e-3, "{name}: flat logits");
    }
}
