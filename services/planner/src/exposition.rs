//! Reading a Prometheus endpoint: one HTTP/1.1 `GET` of its text exposition, and the samples
//! parsed from it (name, labels, value). The router serves its metrics as plain HTTP on its
//! `--metrics-listen` address, as Prometheus scrapes it.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Why a scrape gave nothing.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("{url} is not http://HOST:PORT[/PATH] (the router's metrics are plain HTTP)")]
    BadUrl { url: String },
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url} answered {status}")]
    Status { url: String, status: String },
    #[error("{url}: line {line} is not a Prometheus sample: {text:?}")]
    Malformed {
        url: String,
        line: usize,
        text: String,
    },
}

/// One sample of the text exposition.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Where to scrape: `http://host:port/path` (the path `/metrics` when none is given).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsUrl {
    pub authority: String,
    pub path: String,
}

impl std::str::FromStr for MetricsUrl {
    type Err = ScrapeError;
    fn from_str(url: &str) -> Result<Self, ScrapeError> {
        let bad = || ScrapeError::BadUrl { url: url.into() };
        let rest = match url.split_once("://") {
            Some(("http", rest)) => rest,
            Some(_) => return Err(bad()),
            None => url,
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metrics"),
        };
        if authority.is_empty() || !authority.contains(':') {
            return Err(bad());
        }
        Ok(Self {
            authority: authority.into(),
            path: path.into(),
        })
    }
}

impl std::fmt::Display for MetricsUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

/// Scrapes `url` once, within `timeout`.
pub async fn scrape(url: &MetricsUrl, timeout: Duration) -> Result<Vec<Sample>, ScrapeError> {
    let unreachable = |reason: String| ScrapeError::Unreachable {
        url: url.to_string(),
        reason,
    };
    let body = tokio::time::timeout(timeout, get(url))
        .await
        .map_err(|_| unreachable(format!("no answer within {timeout:?}")))?
        .map_err(|e| unreachable(e.to_string()))?;
    let (head, body) = body
        .split_once("\r\n\r\n")
        .ok_or_else(|| unreachable("the answer is not HTTP".into()))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(ScrapeError::Status {
            url: url.to_string(),
            status: status.into(),
        });
    }
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    parse(&body).map_err(|(line, text)| ScrapeError::Malformed {
        url: url.to_string(),
        line,
        text,
    })
}

async fn get(url: &MetricsUrl) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(&url.authority).await?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n",
        url.path, url.authority
    );
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// A chunked body's data.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size =
            usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// Parses the text exposition; a malformed line is returned with its number (from 1).
pub fn parse(text: &str) -> Result<Vec<Sample>, (usize, String)> {
    let mut samples = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let malformed = || (i + 1, line.to_string());
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let (labels, rest) = parse_labels(&line[open + 1..]).ok_or_else(malformed)?;
                (&line[..open], labels, rest)
            }
            None => {
                let (name, rest) = line.split_once(char::is_whitespace).ok_or_else(malformed)?;
                (name, BTreeMap::new(), rest)
            }
        };
        let value = rest.split_whitespace().next().ok_or_else(malformed)?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().map_err(|_| malformed())?,
        };
        samples.push(Sample {
            name: name.trim().to_string(),
            labels,
            value,
        });
    }
    Ok(samples)
}

/// `a="x",b="y"} rest` → the labels and `rest`.
fn parse_labels(mut s: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start().trim_start_matches(',').trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (name, rest) = s.split_once('=')?;
        let rest = rest.trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.insert(name.trim().to_string(), value);
        s = &rest[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_exposition_parses_with_labels_escapes_and_infinities() {
        let text = "# HELP x help\n# TYPE x counter\nx_total{role=\"router\",model=\"a\\\"b\"} 3\n\
                    h_bucket{le=\"+Inf\"} 7 1700000000\nplain 2.5e1\n";
        let s = parse(text).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name, "x_total");
        assert_eq!(s[0].labels["model"], "a\"b");
        assert_eq!(s[0].value, 3.0);
        assert_eq!(s[1].labels["le"], "+Inf");
        assert_eq!(s[1].value, 7.0);
        assert_eq!((s[2].name.as_str(), s[2].value), ("plain", 25.0));
        assert_eq!(parse("x{a=\"1\" 2\n").unwrap_err().0, 1);
        assert_eq!(parse("ok 1\nbroken\n").unwrap_err().0, 2);
    }

    #[test]
    fn metrics_urls_are_plain_http_with_a_default_path() {
        let u: MetricsUrl = "http://router:9090".parse().unwrap();
        assert_eq!(u.to_string(), "http://router:9090/metrics");
        let u: MetricsUrl = "10.0.0.1:9090/custom".parse().unwrap();
        assert_eq!(
            (u.authority.as_str(), u.path.as_str()),
            ("10.0.0.1:9090", "/custom")
        );
        assert!("https://router:9090".parse::<MetricsUrl>().is_err());
        assert!("router".parse::<MetricsUrl>().is_err());
    }

    #[test]
    fn a_chunked_body_is_joined() {
        assert_eq!(dechunk("4\r\nab c\r\n3\r\nd\ne\r\n0\r\n\r\n"), "ab cd\ne");
    }

    #[tokio::test]
    async fn an_unreachable_endpoint_is_an_error_naming_it() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let url: MetricsUrl = addr.to_string().parse().unwrap();
        let err = scrape(&url, Duration::from_secs(5)).await.unwrap_err();
        assert!(err.to_string().contains(&url.to_string()), "{err}");
    }
}
