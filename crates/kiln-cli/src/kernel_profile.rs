//! `kiln bench --kernel-profile`: where a decode step's time goes, kernel by kernel; and
//! `--step-times`: how a token's time splits between the GPU's step and the host's gap.

use std::io::Write;

use kiln_cuda::{NodeTime, StepProfile, StepTime};

use crate::CliResult;

/// Nodes listed in run order after the summary: enough for the embedding and a layer or two.
const LISTED_IN_ORDER: usize = 40;

/// One kernel's share of a step: its launches and their summed time.
#[derive(Debug, PartialEq)]
struct KernelTotal {
    name: String,
    launches: usize,
    micros: f64,
}

/// The nodes summed per name, the largest total first (ties by name, so the order is stable).
fn totals(nodes: &[NodeTime]) -> Vec<KernelTotal> {
    let mut totals: Vec<KernelTotal> = Vec::new();
    for node in nodes {
        match totals.iter_mut().find(|t| t.name == node.name) {
            Some(t) => {
                t.launches += 1;
                t.micros += f64::from(node.micros);
            }
            None => totals.push(KernelTotal { name: node.name.clone(), launches: 1, micros: f64::from(node.micros) }),
        }
    }
    totals.sort_by(|a, b| b.micros.total_cmp(&a.micros).then_with(|| a.name.cmp(&b.name)));
    totals
}

pub fn print(profiles: &[StepProfile], out: &mut impl Write) -> CliResult {
    if profiles.is_empty() {
        writeln!(out, "\nno step graph was replayed, so none was profiled (decode tests capture one: -n > 0)")?;
    }
    for profile in profiles {
        let sum: f64 = profile.nodes.iter().map(|n| f64::from(n.micros)).sum();
        writeln!(out, "\n### decode step graph {:#x}: {} nodes, {sum:.1} us run serially", profile.key, profile.nodes.len())?;
        writeln!(out, "\n| kernel | launches | total us | mean us | share |\n| --- | ---: | ---: | ---: | ---: |")?;
        for t in totals(&profile.nodes) {
            let share = if sum > 0.0 { 100.0 * t.micros / sum } else { 0.0 };
            writeln!(out, "| {} | {} | {:.1} | {:.2} | {share:.1}% |", t.name, t.launches, t.micros, t.micros / t.launches as f64)?;
        }
        writeln!(out, "\nThe first {LISTED_IN_ORDER} nodes in run order:\n\n| # | kernel | grid | block | us |\n| ---: | --- | --- | --- | ---: |")?;
        for (i, n) in profile.nodes.iter().take(LISTED_IN_ORDER).enumerate() {
            let [gx, gy, gz] = n.grid;
            let [bx, by, bz] = n.block;
            writeln!(out, "| {i} | {} | {gx}x{gy}x{gz} | {bx}x{by}x{bz} | {:.2} |", n.name, n.micros)?;
        }
    }
    Ok(())
}

/// The value at fraction `q` of the sorted values (nearest rank).
fn quantile(sorted: &[f32], q: f64) -> f32 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// One line on the sampled steps: the median device time of a step and the median and 90th
/// percentile of the idle gap before it (the host's share of a token).
pub fn step_times_summary(times: &[StepTime]) -> String {
    if times.is_empty() {
        return "step times: no sampled step was timed (decode tests sample: -n > 0)".into();
    }
    let mut busy: Vec<f32> = times.iter().map(|t| t.busy_us).collect();
    let mut idle: Vec<f32> = times.iter().filter_map(|t| t.idle_before_us).collect();
    busy.sort_by(f32::total_cmp);
    idle.sort_by(f32::total_cmp);
    let mut line = format!("step times: {} sampled steps, GPU busy {:.1} us per step (median)", times.len(), quantile(&busy, 0.5));
    if !idle.is_empty() {
        line += &format!(
            "; GPU idle between consecutive steps (host time per token) {:.1} us median, {:.1} us at the 90th percentile, over {} gaps",
            quantile(&idle, 0.5),
            quantile(&idle, 0.9),
            idle.len()
        );
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, micros: f32) -> NodeTime {
        NodeTime { name: name.into(), grid: [1, 1, 1], block: [32, 1, 1], micros }
    }

    #[test]
    fn totals_sum_launches_per_kernel_largest_first() {
        let nodes = [node("norm", 2.0), node("matvec", 10.0), node("norm", 3.0), node("attn", 4.0), node("matvec", 6.5)];
        let t = totals(&nodes);
        let names: Vec<_> = t.iter().map(|t| (t.name.as_str(), t.launches)).collect();
        assert_eq!(names, [("matvec", 2), ("norm", 2), ("attn", 1)]);
        assert!((t[0].micros - 16.5).abs() < 1e-9 && (t[1].micros - 5.0).abs() < 1e-9);
    }

    #[test]
    fn the_table_names_every_kernel_and_the_serial_sum() {
        let profile = StepProfile { slot: (1, 7), key: 7, nodes: vec![node("a", 1.5), node("b", 2.5)] };
        let mut out = Vec::new();
        print(&[profile], &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("2 nodes, 4.0 us"), "{text}");
        assert!(text.contains("| b | 1 | 2.5 | 2.50 | 62.5% |"), "{text}");
        assert!(text.contains("| 0 | a | 1x1x1 | 32x1x1 | 1.50 |"), "{text}");
    }

    #[test]
    fn step_times_give_medians_and_skip_steps_without_a_gap() {
        let step = |busy_us, idle| StepTime { busy_us, idle_before_us: idle };
        let times = [step(100.0, None), step(90.0, Some(12.0)), step(110.0, Some(8.0)), step(95.0, Some(400.0)), step(105.0, Some(10.0))];
        let line = step_times_summary(&times);
        assert!(line.contains("5 sampled steps, GPU busy 100.0 us"), "{line}");
        assert!(line.contains("12.0 us median"), "{line}");
        assert!(line.contains("400.0 us at the 90th percentile, over 4 gaps"), "{line}");
        assert!(step_times_summary(&[]).contains("no sampled step"));
        assert!(!step_times_summary(&[step(1.0, None)]).contains("idle"));
    }
}
