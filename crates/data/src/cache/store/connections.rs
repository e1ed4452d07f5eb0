//! The connection registry: who is connected, and each connection's pin page in the
//! shared store. A connection that ends is *retired*: its page keeps its leases,
//! which still pin, until the client's rendezvous socket closes too (the client
//! object, and so every lease it handed out, is gone then); only then is the page
//! cleared and given to a new connection. A client that the server dropped while it
//! still held leases thus keeps them, and its stale releases touch only its own page.

use std::collections::HashMap;

use super::super::ids::ClientId;
use super::super::pins::PinPage;
use super::super::protocol::RequestError;
use super::super::table::MAX_CONNECTIONS;

/// One connected client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// Who it is, from its hello.
    pub who: ClientLabel,
    /// Its pin page.
    pub page: usize,
}

/// Who a new connection is: its hello's name, job and pid, and its user as the
/// kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientLabel {
    /// Label for stats and logs.
    pub name: String,
    /// The job it belongs to (`""`: none).
    pub job: String,
    /// Its process id.
    pub pid: u32,
    /// Its user id (the socket peer's).
    pub uid: u32,
}

/// What a disconnect leaves behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departed {
    /// The connection that left.
    pub connection: Connection,
    /// Hits it counted in shared memory.
    pub shared_hits: u64,
}

/// The connected and retired clients.
#[derive(Debug)]
pub struct Connections {
    by_id: HashMap<ClientId, Connection>,
    /// Pages of connections that ended while their client may still hold leases.
    retired: HashMap<ClientId, usize>,
    /// Pages given to no connection, the lowest last.
    free_pages: Vec<usize>,
    /// The server's cursor in each page's ring of reads.
    read_tails: Vec<u64>,
}

impl Default for Connections {
    fn default() -> Self {
        Connections::new()
    }
}

impl Connections {
    /// No connection, every page free.
    pub fn new() -> Connections {
        Connections {
            by_id: HashMap::new(),
            retired: HashMap::new(),
            free_pages: (0..MAX_CONNECTIONS).rev().collect(),
            read_tails: vec![0; MAX_CONNECTIONS],
        }
    }

    /// Registers client `id` and gives it a page, cleared and owned by `id`;
    /// refused when all [`MAX_CONNECTIONS`] pages are taken (by connected or
    /// retired connections).
    pub fn connect<'p>(
        &mut self,
        id: ClientId,
        who: ClientLabel,
        page_of: impl Fn(usize) -> PinPage<'p>,
    ) -> Result<usize, RequestError> {
        if self.by_id.contains_key(&id) || self.retired.contains_key(&id) {
            return Err(RequestError::Protocol(format!(
                "client {id} is connected already"
            )));
        }
        let Some(page) = self.free_pages.pop() else {
            return Err(RequestError::TooManyConnections {
                max: MAX_CONNECTIONS,
            });
        };
        page_of(page).reset(id);
        self.read_tails[page] = 0;
        self.by_id.insert(id, Connection { who, page });
        Ok(page)
    }

    /// Ends client `id`'s connection: its page is retired (its leases still pin)
    /// until [`forget`](Self::forget). `None` if it was not connected.
    pub fn disconnect<'p>(
        &mut self,
        id: ClientId,
        page_of: impl Fn(usize) -> PinPage<'p>,
    ) -> Option<Departed> {
        let connection = self.by_id.remove(&id)?;
        let shared_hits = page_of(connection.page).retire();
        self.retired.insert(id, connection.page);
        Some(Departed {
            connection,
            shared_hits,
        })
    }

    /// Client `id` is gone for good (its rendezvous socket closed): its retired
    /// page is cleared, which releases every lease left in it, and freed. Returns
    /// whether there was one.
    pub fn forget<'p>(&mut self, id: ClientId, page_of: impl Fn(usize) -> PinPage<'p>) -> bool {
        let Some(page) = self.retired.remove(&id) else {
            return false;
        };
        page_of(page).reset(0);
        self.free_pages.push(page);
        true
    }

    /// Client `id`, or an error naming it.
    pub fn get(&self, id: ClientId) -> Result<&Connection, RequestError> {
        self.by_id
            .get(&id)
            .ok_or_else(|| RequestError::Protocol(format!("client {id} is not connected")))
    }

    /// Every connected client, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (ClientId, &Connection)> + '_ {
        self.by_id.iter().map(|(&id, c)| (id, c))
    }

    /// The pages whose leases pin: connected and retired connections'.
    pub fn live_pages(&self) -> impl Iterator<Item = usize> + '_ {
        self.by_id
            .values()
            .map(|c| c.page)
            .chain(self.retired.values().copied())
    }

    /// Connections retired and not yet forgotten.
    pub fn retired(&self) -> usize {
        self.retired.len()
    }

    /// The reads connected clients recorded since the last call, slots below
    /// `slots`, each with the client that made it.
    pub fn drain_reads_by_client<'p>(
        &mut self,
        slots: usize,
        page_of: impl Fn(usize) -> PinPage<'p>,
        out: &mut Vec<(ClientId, usize)>,
    ) {
        let mut reads = Vec::new();
        for (&id, c) in &self.by_id {
            reads.clear();
            page_of(c.page).drain_reads(&mut self.read_tails[c.page], slots, &mut reads);
            out.extend(reads.iter().map(|&slot| (id, slot)));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::super::super::pins::PAGE_WORDS;
    use super::*;

    fn label(name: String, pid: u32) -> ClientLabel {
        ClientLabel {
            name,
            job: String::new(),
            pid,
            uid: 0,
        }
    }

    fn pages() -> Vec<AtomicU64> {
        (0..MAX_CONNECTIONS * PAGE_WORDS)
            .map(|_| AtomicU64::new(0))
            .collect()
    }

    fn page_of<'w>(words: &'w [AtomicU64]) -> impl Fn(usize) -> PinPage<'w> {
        move |p| PinPage::new(&words[p * PAGE_WORDS..(p + 1) * PAGE_WORDS])
    }

    #[test]
    fn pages_run_out_and_come_back_only_when_forgotten() {
        let words = pages();
        let mut conns = Connections::new();
        let got: Vec<usize> = (0..MAX_CONNECTIONS as u64)
            .map(|id| {
                conns
                    .connect(id + 1, label(format!("c{id}"), 7), page_of(&words))
                    .unwrap()
            })
            .collect();
        assert_eq!(got[0], 0);
        let err = conns
            .connect(9999, label("late".into(), 7), page_of(&words))
            .unwrap_err();
        assert_eq!(
            err,
            RequestError::TooManyConnections {
                max: MAX_CONNECTIONS
            }
        );
        let gone = conns.disconnect(8, page_of(&words)).unwrap();
        assert_eq!(gone.connection.page, got[7]);
        assert!(
            conns
                .connect(9999, label("late".into(), 7), page_of(&words))
                .is_err(),
            "a retired page is not handed out"
        );
        assert!(conns.forget(8, page_of(&words)));
        assert!(!conns.forget(8, page_of(&words)), "forgotten already");
        assert_eq!(
            conns.connect(9999, label("late".into(), 7), page_of(&words)),
            Ok(got[7])
        );
        assert_eq!(page_of(&words)(got[7]).owner(), 9999);
    }

    #[test]
    fn a_retired_connection_keeps_pinning_until_forgotten() {
        let words = pages();
        let mut conns = Connections::new();
        let a = conns
            .connect(1, label("a".into(), 10), page_of(&words))
            .unwrap();
        let b = conns
            .connect(2, label("b".into(), 11), page_of(&words))
            .unwrap();
        let pa = page_of(&words)(a);
        pa.take(3).unwrap();
        pa.count_hit();
        pa.count_hit();
        let gone = conns.disconnect(1, page_of(&words)).unwrap();
        assert_eq!(
            (gone.shared_hits, gone.connection.who.name.as_str()),
            (2, "a")
        );
        assert_eq!(
            pa.owner(),
            0,
            "the retired client's shared-memory hits stop"
        );
        let mut live: Vec<usize> = conns.live_pages().collect();
        live.sort_unstable();
        assert_eq!(live, vec![a, b], "a retired page still pins");
        assert!(pa.pins(3));
        assert_eq!(conns.retired(), 1);
        assert!(
            conns.disconnect(1, page_of(&words)).is_none(),
            "gone already"
        );
        assert!(conns.get(1).is_err());
        assert!(conns
            .connect(1, label("again".into(), 10), page_of(&words))
            .is_err_and(|e| e.to_string().contains("connected already")));
        conns.forget(1, page_of(&words));
        assert!(!pa.pins(3), "forgetting clears its leases");
        assert_eq!(conns.live_pages().collect::<Vec<_>>(), vec![b]);
        assert_eq!(conns.get(2).map(|c| c.who.pid), Ok(11));
    }
}
