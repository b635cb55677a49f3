//! Results: a Markdown table for people, JSON for tools, and the problems a quick run asserts on.

use std::time::Duration;

use serde_json::{Value, json};

/// min / p50 / p99 / max of a sample, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) count: usize,
    pub(crate) min: f64,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
}

impl Stats {
    /// Nearest-rank percentiles of `samples`; `None` for an empty sample.
    pub(crate) fn of(samples: &[Duration]) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        ms.sort_by(f64::total_cmp);
        let rank = |q: f64| ms[((q * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
        Some(Stats {
            count: ms.len(),
            min: ms[0],
            p50: rank(0.50),
            p99: rank(0.99),
            max: ms[ms.len() - 1],
        })
    }
}

enum Entry {
    Latency {
        name: String,
        stats: Option<Stats>,
    },
    Value {
        name: String,
        value: f64,
        unit: &'static str,
    },
    Check {
        name: String,
        ok: bool,
        detail: String,
    },
}

/// The labels of [`Report::memory`]'s rows.
pub(crate) struct MemoryLabels<'a> {
    pub(crate) before: &'a str,
    pub(crate) peak: &'a str,
    /// `None`: no row for the RSS after.
    pub(crate) after: Option<&'a str>,
    pub(crate) growth: &'a str,
}

/// All results of a run.
pub(crate) struct Report {
    command: String,
    quick: bool,
    entries: Vec<Entry>,
}

fn machine() -> (usize, String) {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown".into());
    (cores, model)
}

impl Report {
    pub(crate) fn new(command: &str, quick: bool) -> Self {
        Report {
            command: command.to_string(),
            quick,
            entries: Vec::new(),
        }
    }

    /// A latency measure.
    pub(crate) fn latency(&mut self, name: &str, samples: &[Duration]) {
        self.entries.push(Entry::Latency {
            name: name.into(),
            stats: Stats::of(samples),
        });
    }

    /// A single number.
    pub(crate) fn value(&mut self, name: &str, value: f64, unit: &'static str) {
        self.entries.push(Entry::Value {
            name: name.into(),
            value,
            unit,
        });
    }

    /// The memory rows of plugin instances, each `(RSS before, peak RSS, RSS after)` in KiB, shown in MiB: the
    /// largest RSS before, the largest peak, the largest RSS after (where `labels.after` names that row) and
    /// the largest growth, after − before. For at least one instance.
    pub(crate) fn memory(&mut self, memory: &[(u64, u64, u64)], labels: &MemoryLabels<'_>) {
        let mib = |kib: u64| kib as f64 / 1024.0;
        let largest = |f: fn(&(u64, u64, u64)) -> u64| memory.iter().map(f).max().unwrap_or(0);
        self.value(labels.before, mib(largest(|m| m.0)), "MiB");
        self.value(labels.peak, mib(largest(|m| m.1)), "MiB");
        if let Some(after) = labels.after {
            self.value(after, mib(largest(|m| m.2)), "MiB");
        }
        let growth = memory
            .iter()
            .map(|&(before, _, after)| after as f64 - before as f64)
            .fold(f64::MIN, f64::max);
        self.value(labels.growth, growth / 1024.0, "MiB");
    }

    /// A correctness check (final states).
    pub(crate) fn check(&mut self, name: &str, ok: bool, detail: impl Into<String>) {
        self.entries.push(Entry::Check {
            name: name.into(),
            ok,
            detail: detail.into(),
        });
    }

    /// What went wrong: a measure without numbers, or a failed check.
    pub(crate) fn problems(&self) -> Vec<String> {
        self.entries
            .iter()
            .filter_map(|e| match e {
                Entry::Latency { name, stats: None } => Some(format!("{name}: no samples")),
                Entry::Value { name, value, .. } if !value.is_finite() => {
                    Some(format!("{name}: no value"))
                }
                Entry::Check {
                    name,
                    ok: false,
                    detail,
                } => Some(format!("{name}: {detail}")),
                _ => None,
            })
            .collect()
    }

    pub(crate) fn markdown(&self) -> String {
        let (cores, model) = machine();
        let mut out = format!(
            "## Device plugin benchmark{}\n\n- machine: {cores} cores, {model}\n- plugin: `{}`\n\n",
            if self.quick {
                " (quick: small counts, not for comparison)"
            } else {
                ""
            },
            self.command
        );
        out.push_str(
            "| measure | count | min | p50 | p99 | max |\n|---|---:|---:|---:|---:|---:|\n",
        );
        for e in &self.entries {
            if let Entry::Latency { name, stats } = e {
                match stats {
                    Some(s) => out.push_str(&format!(
                        "| {name} (ms) | {} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
                        s.count, s.min, s.p50, s.p99, s.max
                    )),
                    None => out.push_str(&format!("| {name} (ms) | 0 | - | - | - | - |\n")),
                }
            }
        }
        out.push_str("\n| measure | value |\n|---|---:|\n");
        for e in &self.entries {
            match e {
                Entry::Value { name, value, unit } => {
                    out.push_str(&format!("| {name} | {value:.2} {unit} |\n"))
                }
                Entry::Check { name, ok, detail } => out.push_str(&format!(
                    "| {name} | {} {detail} |\n",
                    if *ok { "yes" } else { "**NO**" }
                )),
                Entry::Latency { .. } => {}
            }
        }
        out
    }

    pub(crate) fn json(&self) -> String {
        let (cores, model) = machine();
        let measures: Vec<Value> = self
            .entries
            .iter()
            .map(|e| match e {
                Entry::Latency { name, stats } => json!({
                    "measure": name, "unit": "ms",
                    "count": stats.map_or(0, |s| s.count),
                    "min": stats.map(|s| s.min), "p50": stats.map(|s| s.p50),
                    "p99": stats.map(|s| s.p99), "max": stats.map(|s| s.max),
                }),
                Entry::Value { name, value, unit } => {
                    json!({"measure": name, "value": value, "unit": unit})
                }
                Entry::Check { name, ok, detail } => {
                    json!({"measure": name, "ok": ok, "detail": detail})
                }
            })
            .collect();
        let doc = json!({
            "machine": {"cores": cores, "cpu": model},
            "plugin": self.command,
            "quick": self.quick,
            "measures": measures,
        });
        serde_json::to_string_pretty(&doc).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let s = Stats::of(&samples).map(|s| (s.count, s.min, s.p50, s.p99, s.max));
        assert_eq!(s, Some((100, 1.0, 50.0, 99.0, 100.0)));
        assert!(Stats::of(&[]).is_none());
    }

    #[test]
    fn a_measure_without_samples_or_a_failed_check_is_a_problem() {
        let mut r = Report::new("x", true);
        r.latency("empty", &[]);
        r.check("final list", false, "GPU 0 Healthy");
        r.latency("fine", &[Duration::from_millis(1)]);
        assert_eq!(r.problems().len(), 2);
    }

    #[test]
    fn memory_rows_are_the_largest_of_the_instances_in_mib() {
        let mut r = Report::new("x", true);
        let labels = |after| MemoryLabels {
            before: "before",
            peak: "peak",
            after,
            growth: "growth",
        };
        let memory = [(1024, 4096, 3072), (2048, 2048, 2560)];
        r.memory(&memory, &labels(Some("after")));
        r.memory(&memory, &labels(None));
        let rows: Vec<(&str, f64)> = r
            .entries
            .iter()
            .filter_map(|e| match e {
                Entry::Value { name, value, .. } => Some((name.as_str(), *value)),
                _ => None,
            })
            .collect();
        let all = [
            ("before", 2.0),
            ("peak", 4.0),
            ("after", 3.0),
            ("growth", 2.0),
        ];
        let without_after = [("before", 2.0), ("peak", 4.0), ("growth", 2.0)];
        assert_eq!(rows, [&all[..], &without_after[..]].concat());
    }
}
