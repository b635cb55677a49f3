//! How often the fence directory may warn: its files come from outside, and a detector that rewrites a bad
//! report every millisecond, or leaves a hundred thousand of them, must not fill the node's log. Pure: the
//! caller says what happened and when, and logs what this allows.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// At most one line per source (a file, the directory) in this time, and [`BUDGET`] lines overall; what is
/// held back is counted and said in one line when it ends.
pub const INTERVAL: Duration = Duration::from_secs(60);

/// The most lines in one [`INTERVAL`], whatever the number of sources.
pub const BUDGET: usize = 10;

/// The most sources remembered. Past it, problems with further sources are still counted against the
/// budget, but a repeat of one is not recognised as such.
pub const MAX_SOURCES: usize = 1024;

/// What is remembered of one source.
#[derive(Debug, Clone, Copy)]
struct Source {
    /// The problem last seen, as a version: the same again is no news.
    version: u64,
    /// When a line about it was last logged.
    logged: Option<Instant>,
}

/// The warning limits of one fence directory.
#[derive(Debug)]
pub struct Warnings {
    sources: HashMap<String, Source>,
    /// When the current budget's interval began, and the lines logged in it.
    window: (Instant, usize),
    /// Problems not logged since the last summary, and when the first of them came.
    held_back: Option<(Instant, u64)>,
}

impl Warnings {
    /// No warnings yet, at `now`.
    pub fn new(now: Instant) -> Self {
        Warnings {
            sources: HashMap::new(),
            window: (now, 0),
            held_back: None,
        }
    }

    /// Whether to log a problem with `source`, whose state is `version`, at `now`. The same problem again
    /// (same version) is neither logged nor counted; a new one is logged unless a line about the source
    /// came within [`INTERVAL`] or the budget is spent, and then counted for the summary.
    pub fn allow(&mut self, source: &str, version: u64, now: Instant) -> bool {
        if now.duration_since(self.window.0) >= INTERVAL {
            self.window = (now, 0);
        }
        let known = self.sources.get(source).copied();
        if known.is_some_and(|s| s.version == version) {
            return false;
        }
        let recent = known
            .and_then(|s| s.logged)
            .is_some_and(|at| now.duration_since(at) < INTERVAL);
        let log = !recent && self.window.1 < BUDGET;
        if log {
            self.window.1 += 1;
        } else {
            let (_, count) = self.held_back.get_or_insert((now, 0));
            *count += 1;
        }
        let logged = if log {
            Some(now)
        } else {
            known.and_then(|s| s.logged)
        };
        if known.is_some() || self.sources.len() < MAX_SOURCES {
            self.sources
                .insert(source.to_string(), Source { version, logged });
        }
        log
    }

    /// When [`Warnings::summary`] will have something to say, if it will.
    pub fn summary_due(&self) -> Option<Instant> {
        self.held_back.map(|(since, _)| since + INTERVAL)
    }

    /// The number of problems not logged, once [`INTERVAL`] has passed since the first of them.
    pub fn summary(&mut self, now: Instant) -> Option<u64> {
        let due = self.summary_due()?;
        if now < due {
            return None;
        }
        self.held_back.take().map(|(_, count)| count)
    }

    /// Forgets the sources that have no problem now (`current` says which do) and were not logged about
    /// within [`INTERVAL`]: what is remembered is bounded by what is wrong now.
    pub fn keep_only(&mut self, current: impl Fn(&str) -> bool, now: Instant) {
        self.sources.retain(|name, source| {
            current(name)
                || source
                    .logged
                    .is_some_and(|at| now.duration_since(at) < INTERVAL)
        });
    }

    /// How many sources are remembered.
    #[cfg(test)]
    pub fn remembered(&self) -> usize {
        self.sources.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_is_said_once_and_a_new_one_within_the_interval_is_counted_for_the_summary() {
        let start = Instant::now();
        let mut warnings = Warnings::new(start);
        assert!(warnings.allow("broken.json", 1, start));
        // The same problem again is no news, and not counted.
        assert!(!warnings.allow("broken.json", 1, start + Duration::from_secs(1)));
        assert_eq!(warnings.summary_due(), None);
        // Rewritten a thousand times within the minute: counted, not logged.
        for version in 2..1002 {
            assert!(!warnings.allow("broken.json", version, start + Duration::from_secs(2)));
        }
        let due = warnings.summary_due().unwrap_or(start);
        assert_eq!(due, start + Duration::from_secs(2) + INTERVAL);
        assert_eq!(warnings.summary(due - Duration::from_millis(1)), None);
        assert_eq!(warnings.summary(due), Some(1000));
        assert_eq!(warnings.summary(due), None, "said once");
        // A minute after its last line, the file may be warned about again.
        assert!(warnings.allow("broken.json", 5000, start + INTERVAL));
    }

    #[test]
    fn many_files_get_at_most_the_budget_of_lines_an_interval() {
        let start = Instant::now();
        let mut warnings = Warnings::new(start);
        let logged = (0..100_000)
            .filter(|n| warnings.allow(&format!("r{n}.json"), 1, start))
            .count();
        assert_eq!(logged, BUDGET);
        assert_eq!(
            warnings.summary(start + INTERVAL),
            Some(100_000 - BUDGET as u64)
        );
        assert!(warnings.remembered() <= MAX_SOURCES);
        // The next interval has a budget of its own.
        assert!(warnings.allow("late.json", 1, start + INTERVAL));
    }

    #[test]
    fn sources_without_a_problem_now_are_forgotten_once_their_interval_is_over() {
        let start = Instant::now();
        let mut warnings = Warnings::new(start);
        assert!(warnings.allow("a.json", 1, start));
        assert!(warnings.allow("b.json", 1, start));
        warnings.keep_only(|name| name == "a.json", start + Duration::from_secs(1));
        assert_eq!(warnings.remembered(), 2, "b.json was logged about just now");
        warnings.keep_only(|name| name == "a.json", start + INTERVAL);
        assert_eq!(warnings.remembered(), 1);
        // Still a problem, unchanged: still no news.
        assert!(!warnings.allow("a.json", 1, start + INTERVAL * 2));
    }
}
