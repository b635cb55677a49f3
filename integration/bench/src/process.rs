//! What procfs says about the plugin's process: memory, threads, CPU time and wake-ups, sampled by the
//! measures and the soak.

use std::time::{Duration, Instant};

use anyhow::Context;

use crate::report::Report;

#[derive(Clone, Copy)]
pub(crate) struct ProcSample {
    pub(crate) rss_kib: u64,
    /// The part of RSS that is the process's own memory (heap, stacks); the rest is mapped files, mostly the
    /// binary's code pages, which the kernel can drop and read again.
    pub(crate) rss_anon_kib: u64,
    /// Peak RSS (VmHWM).
    pub(crate) hwm_kib: u64,
    pub(crate) threads: u64,
    /// CPU time, user and system, at the clock tick's resolution.
    pub(crate) cpu: Duration,
    /// Voluntary context switches of every thread: wake-ups.
    pub(crate) voluntary_switches: u64,
}

impl ProcSample {
    /// CPU time used since `before`, in milliseconds.
    pub(crate) fn cpu_ms_since(&self, before: &ProcSample) -> f64 {
        self.cpu.saturating_sub(before.cpu).as_secs_f64() * 1000.0
    }

    /// Wake-ups (voluntary context switches) per second since `before`, `over` ago.
    pub(crate) fn wakeups_per_s_since(&self, before: &ProcSample, over: Duration) -> f64 {
        self.voluntary_switches
            .saturating_sub(before.voluntary_switches) as f64
            / over.as_secs_f64()
    }

    /// An idle spell's two rows, from `before` to this sample, `over` long: the CPU time used, in
    /// milliseconds, and the wake-ups per second, under `labels` (CPU time, wake-ups).
    pub(crate) fn report_idle(
        &self,
        before: &ProcSample,
        over: Duration,
        report: &mut Report,
        labels: [&str; 2],
    ) {
        report.value(labels[0], self.cpu_ms_since(before), "ms");
        report.value(labels[1], self.wakeups_per_s_since(before, over), "/s");
    }

    pub(crate) fn read(pid: u32) -> anyhow::Result<Self> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .context("plugin process is gone")?;
        let field = |text: &str, name: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<u64> = after
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect();
        let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .unwrap_or(100)
            .max(1) as u64;
        // Wake-ups: voluntary switches of every thread, not only the main one.
        let mut voluntary = 0;
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for task in tasks.flatten() {
                if let Ok(text) = std::fs::read_to_string(task.path().join("status")) {
                    voluntary += field(&text, "voluntary_ctxt_switches:");
                }
            }
        }
        Ok(ProcSample {
            rss_kib: field(&status, "VmRSS:"),
            rss_anon_kib: field(&status, "RssAnon:"),
            hwm_kib: field(&status, "VmHWM:"),
            threads: field(&status, "Threads:"),
            cpu: Duration::from_millis(ticks * 1000 / hz),
            voluntary_switches: voluntary,
        })
    }
}

/// Waits until process `pid` uses no CPU time for `quiet`, `limit` at most; whether it did.
pub(crate) async fn settle(pid: u32, quiet: Duration, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    let mut last = ProcSample::read(pid).ok().map(|s| s.cpu);
    let mut since = Instant::now();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = ProcSample::read(pid).ok().map(|s| s.cpu);
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            return true;
        }
    }
    false
}
