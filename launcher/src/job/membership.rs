//! Elastic membership (`--min-nodes`): which of the job's first nodes take part in
//! an attempt, this node's index among them (ranks are renumbered from it), and
//! the factor on the gradient accumulation that keeps the global batch; and node
//! 0's rule when nodes are lost: go on without them while at least `--min-nodes`
//! remain and the global batch can be kept, else end (a lost node 0 always ends
//! the job: it is the one that coordinates); and its rule when lost nodes come
//! back: take them in while the global batch can be kept.

/// The nodes of an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// The nodes taking part, by their index in the job's first membership, in
    /// their new order (a node's new index is its place here).
    pub members: Vec<u32>,
    /// This node's first index.
    pub me: u32,
    /// Nodes in the job's first membership.
    pub first_nnodes: u32,
}

/// Node 0's rule on lost nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterLoss {
    /// The job goes on with these nodes.
    GoOn(Membership),
    /// The job ends: why.
    End(String),
}

impl Membership {
    /// Every node of a job of `nnodes`, seen from node `me`.
    pub fn all(nnodes: u32, me: u32) -> Membership {
        Membership {
            members: (0..nnodes).collect(),
            me,
            first_nnodes: nnodes,
        }
    }

    /// A membership node 0 said (`members`), seen from node `me`.
    pub fn said(&self, members: Vec<u32>) -> Membership {
        Membership {
            members,
            ..self.clone()
        }
    }

    /// Nodes taking part.
    pub fn nnodes(&self) -> u32 {
        self.members.len() as u32
    }

    /// This node's index among them (`None`: it was left out).
    pub fn node_rank(&self) -> Option<u32> {
        self.members
            .iter()
            .position(|node| *node == self.me)
            .map(|place| place as u32)
    }

    /// The factor on the gradient accumulation that keeps the global batch of
    /// the job's first world (every node runs as many ranks).
    pub fn accumulation(&self) -> u32 {
        self.first_nnodes / self.nnodes().max(1)
    }

    /// Node 0's rule on the nodes `lost` under `--min-nodes min_nodes`.
    pub fn after_losses(&self, lost: &[u32], min_nodes: u32) -> AfterLoss {
        if lost.contains(&0) {
            return AfterLoss::End("node 0 was lost: it coordinates, so the job ends".into());
        }
        let members: Vec<u32> = self
            .members
            .iter()
            .copied()
            .filter(|node| !lost.contains(node))
            .collect();
        let remain = members.len() as u32;
        if remain < min_nodes {
            return AfterLoss::End(format!(
                "{remain} node(s) remain, fewer than --min-nodes {min_nodes}"
            ));
        }
        if remain == 0 || self.first_nnodes % remain != 0 {
            return AfterLoss::End(format!(
                "{remain} node(s) cannot keep the global batch of the job's {} (the gradient \
                 accumulation would be {}/{remain}, not a whole number): the job ends as without \
                 --min-nodes",
                self.first_nnodes, self.first_nnodes
            ));
        }
        AfterLoss::GoOn(self.said(members))
    }

    /// Node 0's rule on nodes that came back (`back`): taken in, every node in
    /// its first order (a returning node gets its index back when the nodes
    /// before it are members), while the global batch can be kept; `Err` says why
    /// not (they wait for a membership that can).
    pub fn with_returns(&self, back: &[u32]) -> Result<Membership, String> {
        let mut members = self.members.clone();
        members.extend(back.iter().filter(|node| !self.members.contains(node)));
        members.sort_unstable();
        let n = members.len() as u32;
        if n > self.first_nnodes || self.first_nnodes % n != 0 {
            return Err(format!(
                "{n} node(s) cannot keep the global batch of the job's {} (the gradient \
                 accumulation would be {}/{n}, not a whole number)",
                self.first_nnodes, self.first_nnodes
            ));
        }
        Ok(self.said(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_node_renumbers_the_rest_and_doubles_the_accumulation() {
        let first = Membership::all(4, 3);
        assert_eq!((first.nnodes(), first.node_rank()), (4, Some(3)));
        assert_eq!(first.accumulation(), 1);
        let AfterLoss::GoOn(two) = first.after_losses(&[1, 2], 2) else {
            panic!("two of four remain under --min-nodes 2");
        };
        assert_eq!(two.members, [0, 3]);
        assert_eq!((two.nnodes(), two.node_rank()), (2, Some(1)));
        assert_eq!(two.accumulation(), 2);
        // Node 2 sees itself left out.
        let left_out = Membership::all(4, 2).said(two.members.clone());
        assert_eq!(left_out.node_rank(), None);
        let AfterLoss::GoOn(one) = two.after_losses(&[3], 1) else {
            panic!("one of four remains under --min-nodes 1");
        };
        assert_eq!((one.members.clone(), one.accumulation()), (vec![0], 4));
    }

    #[test]
    fn a_returning_node_gets_its_index_back_and_the_accumulation_shrinks() {
        let two = Membership::all(4, 0).said(vec![0, 3]);
        let back = two.with_returns(&[1]);
        assert!(
            back.as_ref().is_err_and(|why| why.contains("4/3")),
            "{back:?}"
        );
        let four = two.with_returns(&[2, 1]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (four.members.clone(), four.accumulation()),
            (vec![0, 1, 2, 3], 1)
        );
        // Node 3 (its place was 1 of 2) is node 3 again.
        let seen_by_3 = Membership::all(4, 3).said(four.members.clone());
        assert_eq!(seen_by_3.node_rank(), Some(3));
        // Node 3 comes back while nodes 1 and 2 stay lost: it is node 1 of two.
        let one = Membership::all(4, 0).said(vec![0]);
        let two_again = one.with_returns(&[3]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (two_again.members.clone(), two_again.accumulation()),
            (vec![0, 3], 2)
        );
        assert_eq!(
            Membership::all(4, 3).said(two_again.members).node_rank(),
            Some(1)
        );
    }

    #[test]
    fn too_few_nodes_an_uneven_batch_or_a_lost_node_0_end_the_job() {
        let first = Membership::all(3, 0);
        let end = |decision| match decision {
            AfterLoss::End(why) => why,
            AfterLoss::GoOn(m) => panic!("went on with {m:?}"),
        };
        let why = end(first.after_losses(&[1, 2], 2));
        assert!(why.contains("fewer than --min-nodes 2"), "{why}");
        let why = end(first.after_losses(&[2], 1));
        assert!(why.contains("3/2"), "{why}");
        let why = end(first.after_losses(&[0], 1));
        assert!(why.contains("node 0 was lost"), "{why}");
        assert!(matches!(
            first.after_losses(&[1, 2], 1),
            AfterLoss::GoOn(m) if m.members == [0] && m.accumulation() == 3
        ));
    }
}
