//! The image two ways: the Dockerfile (the way a registry gets it) and integration/e2e/mkimage.py (the node
//! e2e's, without docker), which builds what integration/e2e/image.json says. Both must hold the same files at
//! the same paths, built from the same artifacts, and run as the same user with the same entrypoint: a node
//! e2e that passes on one image says nothing of the other otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::collections::BTreeMap;
use std::path::Path;

/// What an image is, as far as the plugin's pod can tell.
#[derive(Debug, PartialEq, Eq)]
struct Image {
    /// Path in the image → the release build's artifact it is.
    files: BTreeMap<String, String>,
    user: String,
    entrypoint: Vec<String>,
}

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("cannot read {}: {e}", full.display()))
}

/// The Dockerfile's lines with continuations joined and comments dropped.
fn instructions(dockerfile: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in dockerfile.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                out.push(std::mem::take(&mut current));
            }
        }
    }
    out
}

/// The runtime stage of the Dockerfile: the files copied from the build stage, traced back through the build
/// stage's `cp target/release/<artifact> <path>` to the artifact; the user; the entrypoint.
fn from_dockerfile(dockerfile: &str) -> Image {
    let lines = instructions(dockerfile);
    // Where each artifact goes in the build stage: `cp target/release/X /out/dir/` or `/out/dir/name`.
    let mut built: BTreeMap<String, String> = BTreeMap::new();
    for line in &lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        for w in words.windows(3) {
            if w[0] == "cp"
                && let Some(artifact) = w[1].strip_prefix("target/release/")
            {
                let dest = if w[2].ends_with('/') {
                    format!("{}{artifact}", w[2])
                } else {
                    w[2].to_string()
                };
                built.insert(dest, artifact.to_string());
            }
        }
    }
    let runtime = lines
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .expect("a FROM");
    let mut image = Image {
        files: BTreeMap::new(),
        user: String::new(),
        entrypoint: Vec::new(),
    };
    for line in &lines[runtime..] {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first().copied() {
            Some("COPY") => {
                assert_eq!(
                    words.get(1).copied(),
                    Some("--from=build"),
                    "the runtime stage copies only from the build stage: {line}"
                );
                let (src, dest) = (words[2], words[3]);
                let artifact = built
                    .get(src)
                    .unwrap_or_else(|| panic!("{src} is not an artifact of the build stage"));
                image.files.insert(dest.to_string(), artifact.clone());
            }
            Some("USER") => image.user = words[1].to_string(),
            Some("ENTRYPOINT") => {
                image.entrypoint = serde_json::from_str(line["ENTRYPOINT".len()..].trim())
                    .expect("ENTRYPOINT in exec form");
            }
            _ => {}
        }
    }
    image
}

fn from_builder(spec: &str) -> Image {
    let spec: serde_json::Value = serde_json::from_str(spec).expect("image.json is JSON");
    let files = spec["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| {
            (
                f["path"].as_str().expect("path").to_string(),
                f["from"].as_str().expect("from").to_string(),
            )
        })
        .collect();
    Image {
        files,
        user: spec["user"].as_str().expect("user").to_string(),
        entrypoint: serde_json::from_value(spec["entrypoint"].clone()).expect("entrypoint"),
    }
}

#[test]
fn the_dockerfile_and_the_e2e_image_builder_describe_the_same_image() {
    let dockerfile = from_dockerfile(&read("Dockerfile"));
    let builder = from_builder(&read("integration/e2e/image.json"));
    assert_eq!(dockerfile, builder);
    // Not vacuous: the binary, the fake library, an unprivileged user, the binary as the entrypoint.
    assert_eq!(
        builder.files.get("/usr/local/bin/gpu-device-plugin"),
        Some(&"gpu-device-plugin".to_string())
    );
    assert_eq!(builder.files.len(), 2);
    assert_eq!(builder.user, "65532:65532");
    assert_eq!(builder.entrypoint, ["/usr/local/bin/gpu-device-plugin"]);
}

#[test]
fn a_file_the_dockerfile_adds_is_a_difference() {
    let with_extra = read("Dockerfile").replace(
        "USER 65532:65532",
        "COPY --from=build /out/bin/gpu-device-plugin /usr/bin/gpu-device-plugin\nUSER 65532:65532",
    );
    let builder = from_builder(&read("integration/e2e/image.json"));
    assert_ne!(from_dockerfile(&with_extra), builder);
    let other_user = read("Dockerfile").replace("USER 65532:65532", "USER 0:0");
    assert_ne!(from_dockerfile(&other_user), builder);
}
