//! Benchmarks a kubelet device plugin for NVIDIA GPUs — ours by default, or any other given by its command
//! line — the same way for every plugin: the fake kubelet plays the kubelet, the fake libnvidia-ml plays the
//! GPUs (first on the child's LD_LIBRARY_PATH as `libnvidia-ml.so.1`), faults are appended to its event file.
//!
//! Measures: the machine's own thread wake-up latency (the floor under the rest), fault → kubelet, kubelet
//! restart → Register, start-up, idle footprint, event storm, Allocate latency, and footprint across many
//! kubelet restarts; for this workspace's plugin also the side surfaces, time-slicing, MIG, abused operator
//! inputs and DRA. Prints a Markdown table and writes JSON.
//! See BENCHMARKS.md.

mod abuse;
mod dra;
mod fault;
mod measure;
mod process;
mod report;
mod rig;
mod soak;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use report::Report;
use rig::Rig;

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "bench",
    about = "Benchmark a GPU device plugin against the fake kubelet and fake NVML"
)]
pub(crate) struct Args {
    /// Plugin command line; `{kubelet_dir}` and `{state_dir}` are replaced [default: this workspace's
    /// gpu-device-plugin --kubelet-dir {kubelet_dir} --state-dir {state_dir}]
    #[arg(long)]
    pub(crate) plugin_cmd: Option<String>,
    /// Device plugin directory the fake kubelet serves [default: a temporary directory]
    #[arg(long)]
    pub(crate) kubelet_dir: Option<PathBuf>,
    /// GPUs the fake library reports
    #[arg(long, default_value_t = 8)]
    pub(crate) devices: usize,
    /// GPUs for the second fault → kubelet run (0 skips it)
    #[arg(long, default_value_t = 512)]
    pub(crate) large_devices: usize,
    /// Small counts, to prove the harness works (CI); asserts results exist and final states are right
    #[arg(long)]
    pub(crate) quick: bool,
    /// Write the results as JSON here
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Kubelet restarts for the footprint soak [default: 300, quick: 10]
    #[arg(long)]
    pub(crate) soak_restarts: Option<usize>,
    /// Run only these measures (comma-separated), e.g. to profile one [default: all]
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) only: Vec<Measure>,
    /// Instead of the measures, soak this workspace's plugin for this long (e.g. `1h`): random faults of
    /// every kind, recoveries, plugin and kubelet restarts and Allocate traffic, the kubelet's view compared
    /// with a model of the health policy throughout (see soak.rs)
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub(crate) soak_for: Option<Duration>,
    /// Seed of the soak's random choices, to run the same soak again [default: the time]
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Nice value added to the abuse's own threads (measure 12), e.g. 10 for an abuser that runs below
    /// the plugin's priority, as the side surfaces do [default: 0, the plugin's fault path's own]
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub(crate) abuse_nice: i32,
}

/// The measures, by name for `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Measure {
    /// The machine's own thread wake-up latency, the floor under every other latency.
    Floor,
    /// Spawn → Register → first list.
    Startup,
    /// Allocate round trips.
    Allocate,
    /// GetPreferredAllocation round trips, as the kubelet asks before it admits a pod, while the plugin's
    /// NVML event thread waits in `nvmlEventSetWait` (as it does whenever no fault comes).
    Preferred,
    /// PreStartContainer round trips.
    Prestart,
    /// Kubelet restart → Register.
    Restart,
    /// Idle footprint.
    Idle,
    /// Footprint after many kubelet restarts.
    Soak,
    /// Event storm.
    Storm,
    /// Fault → kubelet.
    Fault,
    /// Surge rolling-update hand-over on a legacy kubelet.
    Surge,
    /// Fault → kubelet with every surface on (HTTP, pod-resources, Events and the node condition against a
    /// recording API server) and with all of them off, interleaved. This workspace's plugin only.
    Surfaces,
    /// Time-slicing, 100 replicas per GPU (NVIDIA's config file): start-up, and a GPU fault → the kubelet
    /// sees every replica Unhealthy. This workspace's plugin only.
    Replicas,
    /// MIG, 7 MIG devices per GPU under `migStrategy: mixed`: start-up, and an XID attributed to one MIG
    /// device → the kubelet sees it Unhealthy and its neighbours Healthy. This workspace's plugin only.
    Mig,
    /// Fault → kubelet with every operator input on (fence directory, HTTP, control socket, config file),
    /// idle and abused (half-open HTTP connections, a fence directory of reports being rewritten, SIGHUP with
    /// an oversized config), interleaved; idle CPU with every input on; memory before, at the peak of and
    /// after the abuse. This workspace's plugin only.
    Abuse,
    /// Every GPU served through DRA (`--dra all`) against the fake kubelet's DRA side and the fake API server:
    /// fault → the health stream's Unhealthy report, fault → the ResourceSlice's taint, and prepare,
    /// repeated prepare and unprepare round trips; beside the device plugin's fault → kubelet, without and
    /// with the same API access, instance by instance in turn. This workspace's plugin only.
    Dra,
}

impl Args {
    /// Whether `measure` is to run.
    pub(crate) fn runs(&self, measure: Measure) -> bool {
        self.only.is_empty() || self.only.contains(&measure)
    }
}

/// How many of each, full or quick.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counts {
    pub(crate) faults: usize,
    pub(crate) restarts: usize,
    pub(crate) starts: usize,
    pub(crate) idle: Duration,
    pub(crate) storm_rate: u32,
    pub(crate) storm: Duration,
    pub(crate) allocates: usize,
    pub(crate) soak_restarts: usize,
    pub(crate) floor: usize,
    pub(crate) surges: usize,
    /// Half-open HTTP connections held during the abuse.
    pub(crate) abuse_connections: usize,
    /// Report files in the fence directory during the abuse.
    pub(crate) abuse_reports: usize,
    /// Size of the config file put in place before each SIGHUP of the abuse.
    pub(crate) abuse_config_bytes: usize,
    /// The idle window with every input on.
    pub(crate) abuse_idle: Duration,
    /// Added to the abuse threads' nice value.
    pub(crate) abuse_nice: i32,
    /// DRA claims prepared (each also prepared again and unprepared).
    pub(crate) dra_prepares: usize,
}

impl Counts {
    fn new(quick: bool) -> Self {
        if quick {
            Counts {
                faults: 10,
                restarts: 5,
                starts: 3,
                idle: Duration::from_secs(2),
                storm_rate: 2_000,
                storm: Duration::from_secs(1),
                allocates: 50,
                soak_restarts: 10,
                floor: 50,
                surges: 5,
                abuse_connections: 200,
                abuse_reports: 500,
                // Over the plugin's 1 MiB limit, as the full run's is.
                abuse_config_bytes: 2 << 20,
                abuse_idle: Duration::from_secs(3),
                abuse_nice: 0,
                dra_prepares: 20,
            }
        } else {
            Counts {
                faults: 200,
                restarts: 100,
                starts: 20,
                idle: Duration::from_secs(30),
                storm_rate: 10_000,
                storm: Duration::from_secs(10),
                allocates: 1_000,
                soak_restarts: 300,
                floor: 2_000,
                surges: 50,
                abuse_connections: 2_000,
                abuse_reports: 10_000,
                abuse_config_bytes: 10_000_000,
                abuse_idle: Duration::from_secs(30),
                abuse_nice: 0,
                dra_prepares: 1_000,
            }
        }
    }
}

// One thread plays the kubelet: a list arriving at the kubelet side is read, decoded and time-stamped on the
// thread that epoll woke, with no hand-over to another worker that would add the harness's own wake-up to
// every sample. Blocking work (the storm's writer) has a thread of its own.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(report) => {
            print!("{}", report.markdown());
            if let Some(path) = &args.json
                && let Err(e) = std::fs::write(path, report.json())
            {
                eprintln!("bench: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            let problems = report.problems();
            if problems.is_empty() {
                ExitCode::SUCCESS
            } else {
                for p in problems {
                    eprintln!("bench: {p}");
                }
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<Report> {
    let mut counts = Counts::new(args.quick);
    if let Some(n) = args.soak_restarts {
        counts.soak_restarts = n.max(3);
    }
    counts.abuse_nice = args.abuse_nice;
    let rig = Rig::new(args).await?;
    let mut report = Report::new(&rig.plugin_command(), args.quick);
    if let Some(duration) = args.soak_for {
        if !rig.is_ours() {
            anyhow::bail!(
                "--soak-for runs this workspace's plugin only (its config file and flags)"
            );
        }
        let seed = args.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        });
        soak::run(&rig, args.devices, duration, seed, &mut report).await?;
        return Ok(report);
    }
    measure::all(&rig, args, counts, &mut report).await?;
    Ok(report)
}
