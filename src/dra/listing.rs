//! The cluster-wide list of the ResourceClaims that hold devices of this node's pool: what a prepare needs to
//! know before it hands out a device the record does not account for (at the start, and after the record was
//! found damaged, newer or lacking claims held here).
//!
//! No field selector picks a claim by the node it is allocated on, so the list reads every claim in the
//! cluster, in pages: seconds in a large cluster, more than the kubelet gives a prepare call when the API
//! server is slow. So one list runs at a time, on a task of its own that a cancelled call does not take with
//! it, and every call that needs it waits on the same one; its result is kept, and serves every call whose
//! need came before the list began (each list has a generation: a call asks for one at least as new as its
//! need). A call that cannot wait for it any longer is answered before the kubelet's deadline, and the
//! kubelet's next try finds the list done. The list's time ([`MAX_LIST_TIME`]) and pages
//! ([`super::claims::MAX_PAGES`]) are bounded; each list's time and pages are logged and in `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::claims::{Claim, ClaimReader};

/// The longest one list of the claims may take, every page together.
pub const MAX_LIST_TIME: Duration = Duration::from_secs(300);

/// A list of the claims, done.
#[derive(Debug, Clone)]
pub struct Done {
    /// Which list: the first is 1, each later one more.
    pub generation: u64,
    /// Every claim allocated a device of the pool and reserved for a pod, or why there is no list.
    pub result: Result<Arc<Vec<Claim>>, String>,
}

#[derive(Default)]
struct State {
    /// Lists begun.
    started: u64,
    /// The list under way, and when it began.
    running: Option<(watch::Receiver<Option<Done>>, Instant)>,
    /// The latest list that succeeded.
    done: Option<Done>,
    /// The latest list that failed after a call gave up waiting on it, and when: its reason is the answer
    /// for [`FAILURE_KEPT`] (that call learns why at its next try, rather than starting another list).
    failed: Option<(Done, Instant)>,
    /// The newest list a call gave up waiting on.
    gave_up: u64,
}

/// How long a failed list's reason answers the calls that needed it, before a new list is begun.
const FAILURE_KEPT: Duration = Duration::from_secs(10);

/// The one list of the claims of a pool, shared.
#[derive(Clone)]
pub struct Listing {
    claims: Arc<dyn ClaimReader>,
    driver: String,
    pool: String,
    state: Arc<std::sync::Mutex<State>>,
}

impl Listing {
    /// Lists from `claims` the claims holding devices of `driver` in `pool`.
    pub fn new(claims: Arc<dyn ClaimReader>, driver: String, pool: String) -> Self {
        Listing {
            claims,
            driver,
            pool,
            state: Arc::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The generation of a list that begins after now: what a need that arises now asks for.
    pub fn next(&self) -> u64 {
        self.state().started + 1
    }

    /// A list of generation `at_least` or newer: the kept one if it is, else the one under way if it is,
    /// else a new one (after the one under way, if it is older). `Err` when none is done by `until`: the list
    /// goes on without the caller.
    pub async fn wait(
        &self,
        at_least: u64,
        until: Instant,
        metrics: &Arc<crate::metrics::Metrics>,
    ) -> Result<Done, String> {
        loop {
            let (mut running, began) = {
                let mut state = self.state();
                if let Some(done) = state.done.as_ref().filter(|d| d.generation >= at_least) {
                    return Ok(done.clone());
                }
                if let Some((failed, _)) = state
                    .failed
                    .as_ref()
                    .filter(|(d, at)| d.generation >= at_least && at.elapsed() < FAILURE_KEPT)
                {
                    return Ok(failed.clone());
                }
                match &state.running {
                    Some((running, began)) => (running.clone(), *began),
                    None => {
                        state.started += 1;
                        let begun = self.begin(state.started, metrics.clone());
                        state.running = Some(begun.clone());
                        begun
                    }
                }
            };
            let done = tokio::time::timeout_at(until, running.wait_for(Option::is_some)).await;
            let done = match done {
                Err(_) => {
                    let mut state = self.state();
                    state.gave_up = state.gave_up.max(state.started);
                    return Err(format!(
                        "the list of the cluster's ResourceClaims has run for {:.1} s and is not done yet; it \
                         goes on, and the kubelet's next try uses it",
                        began.elapsed().as_secs_f64()
                    ));
                }
                Ok(Err(_)) => return Err("the list of ResourceClaims stopped".to_string()),
                Ok(Ok(done)) => done.clone(),
            };
            match done {
                Some(done) if done.generation >= at_least => return Ok(done),
                // An older list than needed: the next one begins now that it is over.
                _ => continue,
            }
        }
    }

    /// Begins list `generation` on a task of its own.
    fn begin(
        &self,
        generation: u64,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> (watch::Receiver<Option<Done>>, Instant) {
        let (tell, told) = watch::channel(None);
        let began = Instant::now();
        let this = self.clone();
        tokio::spawn(async move {
            let listed = tokio::time::timeout(
                MAX_LIST_TIME,
                this.claims.allocated_in(&this.driver, &this.pool),
            )
            .await;
            let took = began.elapsed();
            let result = match listed {
                Err(_) => Err(format!(
                    "the list of the cluster's ResourceClaims took more than {MAX_LIST_TIME:?}"
                )),
                Ok(Err(e)) => Err(e),
                Ok(Ok(listed)) => {
                    tracing::info!(
                        claims = listed.claims.len(),
                        pages = listed.pages,
                        seconds = took.as_secs_f64(),
                        "claims holding devices of this node listed from the API server"
                    );
                    metrics.claims_listed(took, listed.pages);
                    Ok(Arc::new(listed.claims))
                }
            };
            if let Err(why) = &result {
                tracing::warn!(error = %why, seconds = took.as_secs_f64(), "the claims holding devices of this node cannot be listed");
            }
            let done = Done { generation, result };
            {
                let mut state = this.state();
                state.running = None;
                if done.result.is_ok() {
                    state.done = Some(done.clone());
                    state.failed = None;
                } else if state.gave_up >= generation {
                    state.failed = Some((done.clone(), Instant::now()));
                }
            }
            let _gone = tell.send(Some(done));
        });
        (told, began)
    }
}
