//! SLURM's compressed host lists (`node[01-04,07]`, `a[1-2]-ib,b3`, `r[1-2]n[1-2]`)
//! expanded into host names, so the launcher (and a rank that srun started) can
//! take the first host as MASTER_ADDR without calling `scontrol show hostnames`.

/// Why a host list could not be expanded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad host list {list:?}: {reason}")]
pub struct HostListError {
    /// The list as given.
    pub list: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Expands a host list into its hosts, in order.
///
/// Items are separated by commas outside brackets; each bracket holds numbers and
/// ranges (`01-04`, zero padding kept from the lower bound) separated by commas, and
/// several bracket groups in one item give every combination, left to right.
pub fn expand(list: &str) -> Result<Vec<String>, HostListError> {
    let fail = |reason: String| HostListError {
        list: list.to_string(),
        reason,
    };
    let list_trimmed = list.trim();
    if list_trimmed.is_empty() {
        return Err(fail("it is empty".into()));
    }
    let mut hosts = Vec::new();
    for item in split_top_level(list_trimmed).map_err(fail)? {
        if item.is_empty() {
            return Err(fail("an empty item (two commas in a row?)".into()));
        }
        hosts.extend(expand_item(item).map_err(fail)?);
    }
    Ok(hosts)
}

/// Splits on commas that are not inside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (at, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err(format!("nested '[' at byte {at}")),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(format!("']' without '[' at byte {at}")),
            ']' => depth = 0,
            ',' if depth == 0 => {
                items.push(&list[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err("a '[' is never closed".into());
    }
    items.push(&list[start..]);
    Ok(items)
}

/// Expands one item: literal text and bracket groups, every combination in order.
fn expand_item(item: &str) -> Result<Vec<String>, String> {
    let mut names = vec![String::new()];
    let mut rest = item;
    while !rest.is_empty() {
        match rest.find('[') {
            None => {
                for name in &mut names {
                    name.push_str(rest);
                }
                rest = "";
            }
            Some(open) => {
                let close = rest[open..]
                    .find(']')
                    .map(|at| open + at)
                    .ok_or_else(|| format!("a '[' in {item:?} is never closed"))?;
                let prefix = &rest[..open];
                let choices = expand_ranges(&rest[open + 1..close])
                    .map_err(|reason| format!("in {item:?}: {reason}"))?;
                names = names
                    .iter()
                    .flat_map(|name| {
                        choices
                            .iter()
                            .map(move |choice| format!("{name}{prefix}{choice}"))
                    })
                    .collect();
                rest = &rest[close + 1..];
            }
        }
    }
    Ok(names)
}

/// Expands the inside of one bracket: `01-04,07` -> `01 02 03 04 07`.
fn expand_ranges(inside: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in inside.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err("an empty range".into());
        }
        let (low_text, high_text) = part.split_once('-').unwrap_or((part, part));
        let number = |text: &str| {
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{part:?} is not a number or a range of numbers"));
            }
            text.parse::<u64>()
                .map_err(|_| format!("{text:?} is too large"))
        };
        let (low, high) = (number(low_text)?, number(high_text)?);
        if high < low {
            return Err(format!("range {part:?} runs backwards"));
        }
        if high - low >= 100_000 {
            return Err(format!("range {part:?} has more than 100000 hosts"));
        }
        let width = low_text.len();
        out.extend((low..=high).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn plain_names_and_lists() {
        assert_eq!(hosts("node7"), ["node7"]);
        assert_eq!(hosts("a,b,c"), ["a", "b", "c"]);
    }

    #[test]
    fn ranges_keep_zero_padding() {
        assert_eq!(
            hosts("node[01-04,07]"),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(hosts("gpu[8-11]"), ["gpu8", "gpu9", "gpu10", "gpu11"]);
        assert_eq!(hosts("n[098-101]"), ["n098", "n099", "n100", "n101"]);
    }

    #[test]
    fn suffix_after_brackets_and_mixed_items() {
        assert_eq!(hosts("a[1-2]-ib,b3"), ["a1-ib", "a2-ib", "b3"]);
        assert_eq!(
            hosts("x[1,3],y[10-11].cluster"),
            ["x1", "x3", "y10.cluster", "y11.cluster"]
        );
    }

    #[test]
    fn several_bracket_groups_give_every_combination() {
        assert_eq!(hosts("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
    }

    #[test]
    fn bad_lists_are_errors_that_quote_the_list() {
        for bad in [
            "",
            "node[1-",
            "node]1",
            "node[]",
            "node[a-b]",
            "node[3-1]",
            "a,,b",
            "n[[1]]",
        ] {
            let err = expand(bad).expect_err(bad);
            assert_eq!(err.list, bad);
            assert!(err.to_string().contains("bad host list"), "{err}");
        }
    }
}
