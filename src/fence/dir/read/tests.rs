use std::os::unix::ffi::OsStrExt as _;
use std::time::Duration;

use notify::event::{CreateKind, DataChange, MetadataKind, RemoveKind, RenameMode};

use super::*;

/// Upper bound for a reading that must not block.
const WAIT: Duration = Duration::from_secs(10);

/// `read(dir, keep, cap)` on a thread of its own, so that a reading that blocks fails the test rather than
/// hanging it.
fn read_within(dir: &Path, keep: &[&str], cap: usize) -> Reading {
    let (dir, keep) = (
        dir.to_path_buf(),
        keep.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
    );
    let (done, answer) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _gone = done.send(read(&dir, &keep, cap));
    });
    match answer.recv_timeout(WAIT) {
        Ok(reading) => reading,
        Err(_) => panic!("reading the directory blocked for {WAIT:?}"),
    }
}

fn listed(reading: Reading) -> Listing {
    match reading {
        Reading::Listed(listing) => listing,
        Reading::Unreadable { why } => panic!("unreadable: {why}"),
    }
}

fn mkfifo(path: &Path) {
    let made = std::process::Command::new("mkfifo").arg(path).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
}

const REPORT: &str = r#"{"device": "GPU-1", "reason": "burn-in failed"}"#;

#[test]
fn a_fifo_is_reported_and_held_without_being_waited_on() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    mkfifo(&dir.path().join("pipe.json"));
    std::fs::write(dir.path().join("gpu1.json"), REPORT)?;
    let listing = listed(read_within(dir.path(), &[], MAX_REPORTS));
    assert_eq!(listing.reports.keys().collect::<Vec<_>>(), ["gpu1.json"]);
    assert!(listing.held.contains("pipe.json"));
    assert_eq!(listing.problems.len(), 1);
    assert_eq!(listing.problems[0].why, "not a regular file (a FIFO)");
    Ok(())
}

#[test]
fn a_fifo_swapped_in_after_the_listing_is_refused_at_once() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("pipe.json");
    mkfifo(&path);
    let (done, answer) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _gone = done.send(open_report(&path).err().map(|e| match e {
            Unusable::Gone => "gone".to_string(),
            Unusable::Problem(why, _) => why,
        }));
    });
    let refused = answer.recv_timeout(WAIT).ok().flatten();
    assert_eq!(refused.as_deref(), Some("not a regular file (a FIFO)"));
    Ok(())
}

#[test]
fn a_symbolic_link_is_not_followed_and_its_name_keeps_its_fence() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    let elsewhere = tempfile::tempdir()?;
    std::fs::write(elsewhere.path().join("real.json"), REPORT)?;
    std::os::unix::fs::symlink(
        elsewhere.path().join("real.json"),
        dir.path().join("link.json"),
    )?;
    let listing = listed(read_within(dir.path(), &[], MAX_REPORTS));
    assert!(listing.reports.is_empty());
    assert!(listing.held.contains("link.json"));
    assert!(listing.problems[0].why.contains("symbolic link"));
    Ok(())
}

#[test]
fn an_empty_or_half_written_report_is_held_not_read_as_gone() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("empty.json"), "")?;
    std::fs::write(dir.path().join("blank.json"), " \n")?;
    std::fs::write(dir.path().join("half.json"), r#"{"device": "GPU-"#)?;
    std::fs::write(dir.path().join("big.json"), vec![b' '; 70_000])?;
    let listing = listed(read_within(dir.path(), &[], MAX_REPORTS));
    assert!(listing.reports.is_empty());
    let held: Vec<&str> = listing.held.iter().map(String::as_str).collect();
    assert_eq!(held, ["big.json", "blank.json", "empty.json", "half.json"]);
    assert!(listing.problems.iter().all(|p| p.held));
    let big = listing.problems.iter().find(|p| p.file == "big.json");
    assert!(
        big.is_some_and(|p| p.why.contains("larger than")),
        "{big:?}"
    );
    Ok(())
}

#[test]
fn names_that_cannot_be_keys_are_refused_and_hold_nothing() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    for name in [
        std::ffi::OsStr::new("a:b.json"),
        std::ffi::OsStr::new("evil\n2026 INFO forged.json"),
        std::ffi::OsStr::from_bytes(b"latin\xe9.json"),
    ] {
        std::fs::write(dir.path().join(name), REPORT)?;
    }
    // Skipped without a word: a detector's temporary file, another kind of file.
    std::fs::write(dir.path().join(".gpu1.json.tmp"), REPORT)?;
    std::fs::write(dir.path().join(".hidden.json"), REPORT)?;
    std::fs::write(dir.path().join("notes.txt"), REPORT)?;
    let listing = listed(read_within(dir.path(), &[], MAX_REPORTS));
    assert!(listing.reports.is_empty() && listing.held.is_empty());
    let said: Vec<(&str, &str)> = listing
        .problems
        .iter()
        .map(|p| (p.file.as_str(), p.why.as_str()))
        .collect();
    assert_eq!(
        said,
        [
            ("a:b.json", "its name holds a colon"),
            (
                "evil\\n2026 INFO forged.json",
                "its name holds control characters"
            ),
            ("latin\u{fffd}.json", "its name is not UTF-8"),
        ]
    );
    Ok(())
}

#[test]
fn a_directory_that_cannot_be_listed_says_nothing_about_its_reports() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("file");
    std::fs::write(&file, "")?;
    for path in [dir.path().join("missing"), file] {
        assert!(
            matches!(
                read_within(&path, &[], MAX_REPORTS),
                Reading::Unreadable { .. }
            ),
            "{}",
            path.display()
        );
    }
    Ok(())
}

#[test]
fn only_the_first_reports_by_name_are_read_and_fenced_files_past_them_are_held()
-> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    for name in ["d.json", "b.json", "c.json", "a.json"] {
        std::fs::write(dir.path().join(name), REPORT)?;
    }
    let listing = listed(read_within(dir.path(), &["d.json", "gone.json"], 2));
    assert_eq!(
        listing.reports.keys().collect::<Vec<_>>(),
        ["a.json", "b.json"]
    );
    assert_eq!(listing.unread, 2);
    assert_eq!(
        listing.held.iter().collect::<Vec<_>>(),
        ["d.json"],
        "c.json has no fence to keep; gone.json is gone"
    );
    Ok(())
}

#[test]
fn a_problem_has_a_new_version_when_its_file_changes() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bad.json");
    let version = || {
        listed(read_within(dir.path(), &[], MAX_REPORTS))
            .problems
            .first()
            .map(|p| p.version)
    };
    std::fs::write(&path, "{not json")?;
    let first = version();
    assert!(first.is_some());
    assert_eq!(version(), first, "unchanged");
    std::fs::write(&path, "{not json either")?;
    assert_ne!(version(), first);
    Ok(())
}

#[test]
fn only_changes_wake_the_reader_not_its_own_reading() {
    let event = |kind| Ok(notify::Event::new(kind));
    let reads = [
        EventKind::Access(AccessKind::Open(AccessMode::Any)),
        EventKind::Access(AccessKind::Read),
        EventKind::Access(AccessKind::Close(AccessMode::Read)),
    ];
    for kind in reads {
        assert!(!is_change(&event(kind)), "{kind:?}");
    }
    let changes = [
        EventKind::Access(AccessKind::Close(AccessMode::Write)),
        // A detector that keeps its report open: each write is news.
        EventKind::Modify(ModifyKind::Data(DataChange::Any)),
        EventKind::Create(CreateKind::File),
        EventKind::Remove(RemoveKind::File),
        EventKind::Remove(RemoveKind::Folder),
        EventKind::Modify(ModifyKind::Name(RenameMode::From)),
        EventKind::Modify(ModifyKind::Name(RenameMode::To)),
        EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any)),
        EventKind::Other,
    ];
    for kind in changes {
        assert!(is_change(&event(kind)), "{kind:?}");
    }
    assert!(is_change(&Err(notify::Error::generic("queue overflow"))));
}

#[test]
fn the_watch_is_made_again_when_its_directory_itself_is_removed_or_moved_not_a_file_in_it() {
    let dir = Path::new("/run/fence");
    let event = |kind, path: &Path| Ok(notify::Event::new(kind).add_path(path.to_path_buf()));
    let file = dir.join("gpu1.json");
    for kind in [
        EventKind::Remove(RemoveKind::Folder),
        EventKind::Remove(RemoveKind::Other),
        EventKind::Modify(ModifyKind::Name(RenameMode::From)),
    ] {
        assert!(is_self_gone(&event(kind, dir), dir), "{kind:?}");
        assert!(
            !is_self_gone(&event(kind, &file), dir),
            "{kind:?} of a file"
        );
    }
    let written = EventKind::Access(AccessKind::Close(AccessMode::Write));
    assert!(!is_self_gone(&event(written, dir), dir));
    assert!(is_self_gone(
        &Err(notify::Error::generic("queue overflow")),
        dir
    ));
}
