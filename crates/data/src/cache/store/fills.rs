//! Single-flight fills: at most one fill per key is in flight, under a ticket held
//! by the client that missed first; other clients asking for the key wait for it.
//! A fill ends committed, aborted, or abandoned when its client disconnects; then
//! the key is free again and the next client to ask takes the fill over with a
//! ticket of its own. An abandoned fill's extent is an *orphan* of its client until
//! the client is gone for good (it may still write into it).

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::super::ids::{ClientId, TicketId};
use super::super::protocol::RequestError;
use super::arena::SlotIdx;

/// A fill in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fill {
    /// The key being filled.
    pub key: String,
    /// The client filling it.
    pub client: ClientId,
    /// The slot reserved for it, once reserved.
    pub slot: Option<SlotIdx>,
    /// When the miss gave the ticket.
    pub started: Instant,
}

/// The fills in flight, by ticket, by key and by client.
#[derive(Debug, Default)]
pub struct Fills {
    tickets: HashMap<TicketId, Fill>,
    by_key: HashMap<String, TicketId>,
    by_client: HashMap<ClientId, HashSet<TicketId>>,
    /// Extents of fills abandoned by a disconnect, by client, until it is gone.
    orphans: HashMap<ClientId, Vec<SlotIdx>>,
}

impl Fills {
    /// The fill of `key` in flight, if any.
    pub fn of_key(&self, key: &str) -> Option<(TicketId, &Fill)> {
        let ticket = *self.by_key.get(key)?;
        self.tickets.get(&ticket).map(|fill| (ticket, fill))
    }

    /// Whether a fill of `key` is in flight.
    pub fn is_filling(&self, key: &str) -> bool {
        self.by_key.contains_key(key)
    }

    /// Starts the fill of `key` by `client` under `ticket`; refused while a fill of
    /// the key is in flight or the ticket is in use.
    pub fn start(
        &mut self,
        ticket: TicketId,
        key: &str,
        client: ClientId,
    ) -> Result<(), RequestError> {
        if let Some((held, fill)) = self.of_key(key) {
            return Err(RequestError::Protocol(format!(
                "key {key:?} is being filled already by client {} (ticket {held})",
                fill.client
            )));
        }
        if self.tickets.contains_key(&ticket) {
            return Err(RequestError::Protocol(format!(
                "fill ticket {ticket} is in use"
            )));
        }
        let fill = Fill {
            key: key.to_string(),
            client,
            slot: None,
            started: Instant::now(),
        };
        self.tickets.insert(ticket, fill);
        self.by_key.insert(key.to_string(), ticket);
        self.by_client.entry(client).or_default().insert(ticket);
        Ok(())
    }

    /// The fill under `ticket`, if `client` holds it.
    pub fn held(&self, client: ClientId, ticket: TicketId) -> Result<&Fill, RequestError> {
        match self.tickets.get(&ticket) {
            Some(fill) if fill.client == client => Ok(fill),
            _ => Err(RequestError::TicketNotHeld { ticket }),
        }
    }

    /// Records the slot reserved for `ticket`.
    pub fn set_slot(&mut self, ticket: TicketId, slot: SlotIdx) {
        if let Some(fill) = self.tickets.get_mut(&ticket) {
            fill.slot = Some(slot);
        }
    }

    /// Ends the fill under `ticket` (committed or given up): the key is free again.
    pub fn finish(&mut self, ticket: TicketId) -> Option<Fill> {
        let fill = self.tickets.remove(&ticket)?;
        self.by_key.remove(&fill.key);
        if let Some(mine) = self.by_client.get_mut(&fill.client) {
            mine.remove(&ticket);
            if mine.is_empty() {
                self.by_client.remove(&fill.client);
            }
        }
        Some(fill)
    }

    /// Ends every fill of `client` (it disconnected) and keeps their extents as
    /// its orphans (see [`Fills::take_orphans`]); returns the fills.
    pub fn abandon_all(&mut self, client: ClientId) -> Vec<Fill> {
        let tickets = self.by_client.remove(&client).unwrap_or_default();
        let abandoned: Vec<Fill> = tickets
            .into_iter()
            .filter_map(|ticket| self.finish(ticket))
            .collect();
        let slots = abandoned.iter().filter_map(|fill| fill.slot);
        self.orphans.entry(client).or_default().extend(slots);
        abandoned
    }

    /// The extents of `client`'s abandoned fills, once it is gone for good: they
    /// may be freed now.
    pub fn take_orphans(&mut self, client: ClientId) -> Vec<SlotIdx> {
        self.orphans.remove(&client).unwrap_or_default()
    }

    /// Fills in flight.
    pub fn len(&self) -> usize {
        self.tickets.len()
    }

    /// Whether no fill is in flight.
    pub fn is_empty(&self) -> bool {
        self.tickets.is_empty()
    }

    /// Fills in flight of `client`.
    pub fn count_of(&self, client: ClientId) -> usize {
        self.by_client.get(&client).map_or(0, HashSet::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_fill_per_key_held_by_its_client_only() {
        let mut fills = Fills::default();
        fills.start(10, "k", 1).unwrap();
        assert!(fills.is_filling("k"));
        let err = fills.start(11, "k", 2).unwrap_err();
        assert!(err.to_string().contains("client 1"), "{err}");
        assert!(fills.start(10, "other", 2).is_err(), "ticket in use");
        assert_eq!(fills.of_key("k").map(|(t, f)| (t, f.client)), Some((10, 1)));
        assert!(fills.held(1, 10).is_ok());
        assert_eq!(
            fills.held(2, 10),
            Err(RequestError::TicketNotHeld { ticket: 10 })
        );
        fills.set_slot(10, 4);
        let done = fills.finish(10).unwrap();
        assert_eq!((done.key.as_str(), done.slot), ("k", Some(4)));
        assert!(!fills.is_filling("k") && fills.is_empty());
        assert!(fills.finish(10).is_none(), "finished already");
    }

    #[test]
    fn a_disconnect_abandons_only_that_clients_fills_and_frees_their_keys() {
        let mut fills = Fills::default();
        fills.start(1, "a", 100).unwrap();
        fills.start(2, "b", 100).unwrap();
        fills.start(3, "c", 200).unwrap();
        assert_eq!((fills.count_of(100), fills.count_of(200)), (2, 1));
        let mut gone: Vec<String> = (fills.abandon_all(100).into_iter())
            .map(|f| f.key)
            .collect();
        gone.sort();
        assert_eq!(gone, vec!["a", "b"]);
        assert_eq!((fills.len(), fills.count_of(100)), (1, 0));
        // The next client to ask takes the abandoned key over.
        fills.start(4, "a", 200).unwrap();
        assert_eq!(fills.held(200, 4).map(|f| f.key.as_str()), Ok("a"));
        assert!(fills.abandon_all(100).is_empty());
    }

    #[test]
    fn abandoned_extents_stay_the_clients_until_taken() {
        let mut fills = Fills::default();
        fills.start(1, "a", 100).unwrap();
        fills.start(2, "b", 100).unwrap();
        fills.set_slot(1, 7);
        assert_eq!(fills.abandon_all(100).len(), 2);
        assert!(!fills.is_filling("a"), "the key is free at once");
        assert_eq!(fills.take_orphans(100), vec![7], "b had no extent yet");
        assert!(fills.take_orphans(100).is_empty(), "taken once");
    }
}
