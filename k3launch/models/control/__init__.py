"""The one controller, its pure part: what commands want (:mod:`.spec`), what a look sees
(:mod:`.observation`), what the controller remembers (:mod:`.memory`), what it may do
(:mod:`.actions`), and the decisions (:mod:`.decisions`, with :mod:`.converge` for rollouts and
router membership and :mod:`.scaling` for copies and standbys). No I/O; time is passed in. Its
hands and its loop: :mod:`k3launch.deploy.control`."""
