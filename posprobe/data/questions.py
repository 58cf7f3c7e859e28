"""Neutral questions and small-talk turns for the key squishing study (issue 40).

The questions, reference answers and conversation turns here were written for posprobe. Each question is an
everyday or general-knowledge one that a small chat model can answer in a sentence or two, with a short correct
reference. None asks for a language, a letter case or a format, and none mentions what the built-in instructions
check (languages by name, letter case, commas, JSON, pirates, the keyword), so whether an answer follows an
instruction depends on the instruction alone. `FILLER_TURNS` are (user, assistant) pairs of small talk put between
an instruction and the question; their replies are plain English and follow none of the instructions.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from posprobe.data.records import DataError, json_records, read_lines

__all__ = ["BUILTIN_QUESTIONS", "COOKING", "FILLER_TURNS", "Question", "builtin_questions", "load_questions"]


@dataclass(frozen=True)
class Question:
    """A question, a short correct reference answer ("" when none is known) and its topic ("" when untagged; a
    conditional instruction such as "answer cooking questions in French" concerns the questions of one topic)."""

    text: str
    reference: str = ""
    topic: str = ""


_QA: tuple[tuple[str, str], ...] = (
    # science and nature
    ("Why is the sky blue?", "Air molecules scatter sunlight and blue light is scattered the most."),
    ("What gas do plants take in from the air to make their food?", "Plants take in carbon dioxide."),
    ("At what temperature does water boil at sea level?", "Water boils at 100 degrees Celsius at sea level."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the closest star to Earth?", "The Sun is the closest star to Earth."),
    ("Which planet is known as the Red Planet?", "Mars is known as the Red Planet."),
    ("What force keeps us on the ground?", "Gravity keeps us on the ground."),
    ("What do bees make from nectar?", "Bees make honey from nectar."),
    ("How many bones are in an adult human body?", "An adult human body has 206 bones."),
    ("What is the largest planet in our solar system?", "Jupiter is the largest planet in our solar system."),
    ("Which organ pumps blood around the body?", "The heart pumps blood around the body."),
    ("Why does the Earth have seasons?", "The tilt of the Earth's axis changes how much sunlight each half gets "
     "during the year."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
    ("How long does it take the Earth to travel around the Sun?", "It takes the Earth about 365 days."),
    ("What do caterpillars turn into?", "Caterpillars turn into butterflies or moths."),
    ("What is the hardest natural material?", "Diamond is the hardest natural material."),
    ("Which gas makes up most of the air we breathe?", "Nitrogen makes up most of the air."),
    ("What causes thunder?", "Lightning heats the air so fast that it expands with a loud bang."),
    ("How many hearts does an octopus have?", "An octopus has three hearts."),
    ("What is the main job of the lungs?", "The lungs take oxygen into the body and remove carbon dioxide."),
    ("Why do leaves change colour in autumn?", "The green chlorophyll breaks down and reveals yellow and red "
     "pigments."),
    ("How fast does light travel?", "Light travels at about 300000 kilometres per second."),
    ("Is a whale a fish or a mammal?", "A whale is a mammal."),
    ("Which part of a plant takes up water from the soil?", "The roots take up water from the soil."),
    ("What does a thermometer measure?", "A thermometer measures temperature."),
    ("How many moons does the Earth have?", "The Earth has one moon."),
    ("How does a rainbow form?", "Raindrops bend and split sunlight into its colours."),
    ("Why does a metal spoon feel colder than a wooden one?", "Metal carries heat away from your hand faster "
     "than wood."),
    ("What do you call an animal that eats only plants?", "An animal that eats only plants is a herbivore."),
    ("What is the freezing point of water?", "Water freezes at 0 degrees Celsius."),
    ("What do we call animals that are active at night?", "Animals active at night are called nocturnal."),
    ("Why do we see lightning before we hear thunder?", "Light travels much faster than sound."),
    ("What are the three states of matter we meet every day?", "They are solid and liquid and gas."),
    ("What is the largest organ of the human body?", "The skin is the largest organ of the human body."),
    ("How do fish breathe under water?", "Fish take oxygen from the water with their gills."),
    ("What is photosynthesis?", "Photosynthesis is how plants use sunlight to make sugar from water and carbon "
     "dioxide."),
    ("Why does ice float on water?", "Ice is less dense than liquid water."),
    # geography
    ("What is the capital of Japan?", "Tokyo is the capital of Japan."),
    ("What is the longest river in Africa?", "The Nile is the longest river in Africa."),
    ("On which continent is Brazil?", "Brazil is in South America."),
    ("What is the largest ocean on Earth?", "The Pacific Ocean is the largest ocean on Earth."),
    ("What is the tallest mountain in the world?", "Mount Everest is the tallest mountain above sea level."),
    ("What is the largest hot desert in the world?", "The Sahara is the largest hot desert."),
    ("What is the capital of Australia?", "Canberra is the capital of Australia."),
    ("Which country is shaped like a boot?", "Italy is shaped like a boot."),
    ("What is the capital of Canada?", "Ottawa is the capital of Canada."),
    ("How many continents are there?", "There are seven continents."),
    ("In which city is the Eiffel Tower?", "The Eiffel Tower is in Paris."),
    ("What is the capital of Egypt?", "Cairo is the capital of Egypt."),
    ("Which ocean lies between Europe and North America?", "The Atlantic Ocean lies between them."),
    ("What is the smallest country in the world?", "Vatican City is the smallest country in the world."),
    ("Which river flows through London?", "The Thames flows through London."),
    ("What is the capital of Kenya?", "Nairobi is the capital of Kenya."),
    ("Which is the largest country by area?", "Russia is the largest country by area."),
    ("Which sea lies between Europe and Africa?", "The Mediterranean Sea lies between Europe and Africa."),
    ("Which mountain range is often taken as the border between Europe and Asia?", "The Ural Mountains are often "
     "taken as that border."),
    ("What is the capital of Peru?", "Lima is the capital of Peru."),
    ("Which country is home to the kangaroo?", "Kangaroos live in Australia."),
    ("On which continent is the South Pole?", "The South Pole is in Antarctica."),
    ("What is the largest island in the world?", "Greenland is the largest island in the world."),
    # cooking and food
    ("How long should I boil an egg to get a firm yolk?", "About ten minutes in boiling water gives a firm yolk."),
    ("What is the main ingredient in guacamole?", "Avocado is the main ingredient in guacamole."),
    ("Why do people add salt to the water when cooking pasta?", "The salt seasons the pasta as it cooks."),
    ("What makes bread dough rise?", "Yeast makes gas that puffs up the dough."),
    ("How can I tell when pasta is cooked?", "It is ready when it is tender but still a little firm to the bite."),
    ("What is the difference between baking soda and baking powder?", "Baking powder already contains an acid "
     "while baking soda needs one from the recipe."),
    ("Why should meat rest after cooking?", "Resting lets the juices settle so the meat stays moist."),
    ("What is tofu made from?", "Tofu is made from soybeans."),
    ("How can I stop cut apples from turning brown?", "A little lemon juice keeps cut apples from browning."),
    ("What is the main ingredient of hummus?", "Hummus is made mostly from chickpeas."),
    ("Why do onions make people cry?", "Cutting an onion releases a gas that stings the eyes."),
    ("What kind of rice is used for risotto?", "Risotto uses short grain rice such as arborio."),
    ("How can I soften brown sugar that has gone hard?", "Seal it in a container with a slice of bread overnight."),
    ("How should I store fresh herbs?", "Keep them in a glass of water or wrapped in a damp towel in the fridge."),
    ("Which spice gives curry its yellow colour?", "Turmeric gives curry its yellow colour."),
    ("What is the main ingredient in chocolate?", "Chocolate is made from cocoa beans."),
    ("How do I know if an egg is still fresh?", "A fresh egg sinks and lies flat in a bowl of water."),
    ("Why should raw chicken be kept away from salads?", "Raw chicken can carry germs that spread to food "
     "that is not cooked."),
    ("What is a good way to reheat rice safely?", "Heat it until it is steaming hot all the way through and only "
     "reheat it once."),
    # everyday advice
    ("How can I fall asleep more easily?", "Keep a regular bedtime and put screens away before bed."),
    ("How often should I water a cactus?", "Water a cactus only when its soil has dried out completely."),
    ("What is a good way to remember someone's name?", "Say the name back when you are introduced."),
    ("How can I spend less on groceries?", "Plan your meals and shop with a list."),
    ("How do I get a coffee stain out of a shirt?", "Rinse it in cold water and rub in detergent before washing."),
    ("How long should I brush my teeth?", "Brush your teeth for about two minutes."),
    ("What should I bring on a day hike?", "Bring water and snacks and a rain jacket and a map."),
    ("How can I stay focused while studying?", "Work in short blocks with breaks and keep your phone out of reach."),
    ("How do I keep houseplants healthy?", "Give them enough light and water them only when the soil is dry."),
    ("What should I do if my phone gets wet?", "Turn it off and let it dry completely before charging it."),
    ("How can I make my mornings less rushed?", "Lay out your clothes and plan breakfast the night before."),
    ("How much water should an adult drink each day?", "About two litres a day is a common guideline."),
    ("What is a good way to start exercising?", "Start with short walks and build up slowly."),
    ("How can I unwind after a busy day?", "A short walk or some quiet time can help you relax."),
    ("How should I prepare for a job interview?", "Learn about the company and practise answers to common "
     "questions."),
    ("How do I clear a slow kitchen sink?", "Pour hot water down it and try a plunger before using a cleaner."),
    ("How can I keep my bike chain working well?", "Clean it and oil it every few weeks."),
    ("What should I do before lifting a heavy box?", "Bend your knees and keep your back straight as you lift."),
    ("How can I make a room feel cooler in summer?", "Close the curtains during the day and open windows at night."),
    ("How do I stop a cut from bleeding?", "Press a clean cloth firmly on the cut for a few minutes."),
    ("How can I make my phone battery last longer?", "Lower the screen brightness and close apps you are not using."),
    # history
    ("Who was the first person to walk on the Moon?", "Neil Armstrong was the first person to walk on the Moon."),
    ("In which year did the Second World War end?", "The Second World War ended in 1945."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa."),
    ("Who built the pyramids of Giza?", "The ancient Egyptians built the pyramids of Giza."),
    ("Who is credited with inventing the telephone?", "Alexander Graham Bell is credited with the telephone."),
    ("What happened to the Titanic?", "The Titanic hit an iceberg and sank in 1912."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("Why was the Great Wall of China built?", "It was built to protect against raids from the north."),
    ("Who was the first President of the United States?", "George Washington was the first President."),
    ("In which city is the Colosseum?", "The Colosseum is in Rome."),
    ("What did the Wright brothers achieve?", "They made the first successful powered aeroplane flight."),
    ("In which year did the Berlin Wall fall?", "The Berlin Wall fell in 1989."),
    ("Who discovered penicillin?", "Alexander Fleming discovered penicillin."),
    ("Why was the printing press important?", "It made books much cheaper and faster to produce."),
    ("Who was Cleopatra?", "Cleopatra was the last queen of ancient Egypt."),
    ("Which ship carried the Pilgrims to America in 1620?", "The Mayflower carried the Pilgrims."),
    ("Who developed the theory of relativity?", "Albert Einstein developed the theory of relativity."),
    # words and meanings
    ("What is the opposite of ancient?", "The opposite of ancient is modern."),
    ("What is another word for happy?", "Joyful is another word for happy."),
    ("What is the plural of mouse?", "The plural of mouse is mice."),
    ("What does enormous mean?", "Enormous means very large."),
    ("What is a noun?", "A noun is a word for a person or place or thing."),
    ("What is the past tense of run?", "The past tense of run is ran."),
    ("What is a haiku?", "A haiku is a short poem of three lines with five and seven and five syllables."),
    ("What does punctual mean?", "Punctual means arriving on time."),
    ("What is an antonym?", "An antonym is a word with the opposite meaning."),
    ("What does it mean to borrow something?", "To borrow something is to take it for a while and give it back."),
    # simple arithmetic
    ("If I have 3 apples and buy 5 more, how many apples do I have?", "You have 8 apples."),
    ("A train travels 60 kilometres in one hour. How far does it go in three hours?", "It goes 180 kilometres."),
    ("What is half of 50?", "Half of 50 is 25."),
    ("A pizza is cut into 8 slices and I eat 3. How many slices are left?", "There are 5 slices left."),
    ("How many minutes are in two hours?", "There are 120 minutes in two hours."),
    ("A shirt costs 20 dollars and is 25 percent off. What is the new price?", "The new price is 15 dollars."),
    ("What is 12 times 12?", "The answer is 144."),
    ("How many days are in four weeks?", "There are 28 days in four weeks."),
    ("I have 10 dollars and spend 4. How much do I have left?", "You have 6 dollars left."),
    ("What do the angles of a triangle add up to?", "The angles of a triangle add up to 180 degrees."),
    ("How many sides does a hexagon have?", "A hexagon has six sides."),
    ("Three friends share 12 cookies equally. How many does each friend get?", "Each friend gets 4 cookies."),
    ("What is 15 plus 27?", "The answer is 42."),
    ("How many hours are in a day?", "There are 24 hours in a day."),
    ("If a book costs 8 dollars, how much do three books cost?", "Three books cost 24 dollars."),
    # animals, technology and everyday things
    ("What does the processor of a computer do?", "The processor carries out the instructions of programs."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal."),
    ("What do giant pandas mainly eat?", "Giant pandas mainly eat bamboo."),
    ("Why do cats purr?", "Cats often purr when they are content and sometimes to calm themselves."),
    ("How do birds stay up in the air?", "Their wings push air downwards and create lift."),
    ("What is the largest animal that has ever lived?", "The blue whale is the largest animal known to have lived."),
    ("What is a wireless network?", "A wireless network connects devices without cables."),
    ("What is a password manager?", "A password manager is an app that stores your passwords securely."),
    ("What happens to the things we recycle?", "Recycled materials are turned into new products."),
    ("How many players does a football team have on the pitch?", "A football team has eleven players on the "
     "pitch."),
    ("How many strings does a standard guitar have?", "A standard guitar has six strings."),
    ("How many keys does a standard piano have?", "A standard piano has 88 keys."),
    ("How often are the Summer Olympic Games held?", "The Summer Olympic Games are held every four years."),
    ("What colour do you get by mixing blue and yellow?", "Mixing blue and yellow gives green."),
    ("How many days are in a leap year?", "A leap year has 366 days."),
    ("What is a baby kangaroo called?", "A baby kangaroo is called a joey."),
    ("Why do we need sleep?", "Sleep lets the body and brain rest and repair themselves."),
    ("Why do dogs pant?", "Dogs pant to cool themselves down."),
    ("What is a compass used for?", "A compass shows which way is north."),
    ("Why do we wear seat belts in cars?", "Seat belts hold us in place and protect us in a crash."),
)

#: Questions about cooking and food (the topic of the conditional built-in instruction `french_cooking`).
COOKING = frozenset({
    "How long should I boil an egg to get a firm yolk?", "Why do people add salt to the water when cooking pasta?",
    "What makes bread dough rise?", "How can I tell when pasta is cooked?",
    "What is the difference between baking soda and baking powder?", "Why should meat rest after cooking?",
    "How can I stop cut apples from turning brown?", "What kind of rice is used for risotto?",
    "How can I soften brown sugar that has gone hard?", "Which spice gives curry its yellow colour?",
    "What is the main ingredient in chocolate?", "How do I know if an egg is still fresh?",
    "What is a good way to reheat rice safely?",
})


def _spread(n: int, stride: int = 37) -> list[int]:
    # The questions are written in topic groups; a stride coprime with n visits every index once and spreads each
    # group over the whole order, so the first N questions (the study's default) mix the topics.
    assert n % stride and all(n % p or stride % p for p in range(2, stride + 1))
    return sorted(range(n), key=lambda i: (i * stride) % n)


#: The built-in questions, in a fixed order that mixes the topics.
BUILTIN_QUESTIONS: tuple[Question, ...] = tuple(
    Question(_QA[i][0], _QA[i][1], "cooking" if _QA[i][0] in COOKING else "") for i in _spread(len(_QA)))

#: Small talk (user, assistant), in conversation order, for turns between an instruction and the question.
FILLER_TURNS: tuple[tuple[str, str], ...] = (
    ("Hi there!", "Hello! It is nice to hear from you."),
    ("How are you today?", "I am doing well, thank you for asking. How about you?"),
    ("I'm fine, just a bit tired.", "Sorry to hear that. I hope you get some rest soon."),
    ("The weather is lovely today.", "That sounds wonderful. A sunny day can really lift the mood."),
    ("I went for a walk this morning.", "A morning walk is a great way to start the day. Did you go anywhere nice?"),
    ("Just around the park near my house.", "Parks are lovely places for a walk. It is nice to have one close by."),
    ("I had pancakes for breakfast.", "Pancakes make a tasty breakfast. Did you have them with anything?"),
    ("Some honey and fresh berries.", "That sounds delicious and a little healthy too."),
    ("I'm thinking about reading a new book.", "Reading is a great way to relax. Do you have a favourite kind of "
     "story?"),
    ("I like mysteries.", "Mysteries can be very gripping. It is fun to guess the ending before it comes."),
    ("My cat knocked a cup off the table again.", "Cats do seem to enjoy that. I hope the cup survived."),
    ("It did, luckily.", "That is good news. Maybe keep cups away from the edge for a while."),
    ("I started learning the piano.", "That is exciting. Playing a little every day helps a lot."),
    ("It's harder than I expected.", "Most new skills feel hard at first. They usually get easier with practice."),
    ("Do you like music?", "I do not listen to music myself, but I enjoy talking about it."),
    ("My friend is visiting this weekend.", "How nice. I hope the two of you have a great time together."),
    ("We might go to the cinema.", "A film is a fun plan. I hope you pick a good one."),
    ("I planted some tomatoes in the garden.", "Growing your own tomatoes is very rewarding. They taste great "
     "fresh."),
    ("It rained all night.", "Your garden will probably be happy about that."),
    ("I'm trying to drink more water.", "That is a good habit. Keeping a bottle nearby can help."),
    ("I cleaned my whole flat yesterday.", "Well done. A tidy home can feel very calming."),
    ("Thanks for chatting with me.", "You are welcome. I am enjoying our conversation."),
    ("What's your favourite season?", "I do not have one myself, but many people love spring for its flowers."),
    ("I love autumn.", "Autumn is beautiful with all its colourful leaves."),
    ("I baked cookies for my neighbours.", "That is very kind of you. I am sure they appreciated it."),
    ("My bus was late this morning.", "That can be frustrating. I hope the rest of your day went smoothly."),
    ("I finished a jigsaw with a thousand pieces.", "Congratulations. That takes a lot of patience."),
    ("I might take up running.", "Running is a good way to stay fit. Starting slowly helps you avoid injuries."),
    ("My sister just had a baby.", "Congratulations to your family. That is wonderful news."),
    ("I watched the sunset last night.", "Sunsets can be beautiful. It is nice to take a moment to enjoy them."),
    ("I'm going to make soup for dinner.", "Soup is a cosy choice for dinner. What kind are you making?"),
    ("Vegetable soup, I think.", "Vegetable soup is tasty and good for you."),
    ("I've been enjoying quiet evenings lately.", "Quiet evenings can be very restful. It is nice to slow down "
     "sometimes."),
    ("My neighbour lent me a ladder.", "That was helpful of them. Good neighbours make life easier."),
    ("I tried a new café in town.", "Trying new places can be fun. I hope you liked it."),
)


def builtin_questions(n: int | None = None) -> list[Question]:
    """Return the first `n` built-in questions (all of them when `n` is None). Raises ValueError when `n` is below
    1 or above the number there are."""
    if n is None:
        return list(BUILTIN_QUESTIONS)
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if n > len(BUILTIN_QUESTIONS):
        raise ValueError(f"asked for {n} questions but there are only {len(BUILTIN_QUESTIONS)} built-in ones")
    return list(BUILTIN_QUESTIONS[:n])


def load_questions(path: str | Path) -> list[Question]:
    """Return the questions of a file: `.jsonl` with a "question" (and optional "reference") per line, or any other
    file as plain text, one question per line (reference ""). Blank lines are ignored. Raises DataError (a
    ValueError) for an unreadable or empty file, and naming the line for malformed JSON or a missing question."""
    path = Path(path)
    origin = f"questions file {path}"
    lines = read_lines(path, origin)
    jsonl = path.suffix.lower() == ".jsonl"
    questions = [] if jsonl else [Question(line.strip()) for line in lines if line.strip()]
    for where, rec in json_records(lines if jsonl else (), origin):
        text, reference = rec.get("question"), rec.get("reference", "")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: needs a non-empty string under \"question\"")
        if not isinstance(reference, str):
            raise DataError(f"{where}: \"reference\" must be a string, got {type(reference).__name__}")
        questions.append(Question(text.strip(), reference.strip()))
    if not questions:
        raise DataError(f"{origin}: no questions (the file is empty)")
    return questions
